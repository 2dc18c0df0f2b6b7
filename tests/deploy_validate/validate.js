// Offline schema check of Kubernetes objects, for tests/integration/test_deploy.py.
//
//   kubectl kustomize deploy/k8s/overlays/daemonset | node validate.js
//
// Reads YAML or JSON from stdin (one or more documents, or a `kind: List`), and
// for every object:
//   1. `new <Kind>(obj).validate()` from the npm package kubernetes-models (the
//      Kubernetes OpenAPI schemas compiled with Ajv): types, enums, required
//      fields, formats;
//   2. an unknown-field check, which kubernetes-models does not do: every key of
//      every object whose type is a known Kubernetes struct must be a field of
//      that struct (a typo such as `readOnlyRootFileSystem` would otherwise pass
//      and be rejected only by the API server's strict field validation).
//      The field lists come from the package's TypeScript declarations.
//   3. the API server's rules on a container's resources, which are not in
//      the OpenAPI schemas (ValidateResourceRequirements in
//      k8s.io/kubernetes pkg/apis/core/validation): a request is at most its
//      limit; for resources that cannot be overcommitted (hugepages-<size>
//      and extended resources such as nvidia.com/gpu) a request needs a limit
//      and equals it; a container with hugepages requests or limits cpu or
//      memory too ("HugePages require cpu or memory").
// Prints a JSON array [{kind, name, ok, errors: [...]}, ...] on stdout, one
// human line per object on stderr, and exits 0 when every object is valid,
// 1 when any is not, 2 when the input cannot be read or names an unknown kind.
import { readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { parseAllDocuments } from "yaml";

const require = createRequire(import.meta.url);

// ---- interface table from the .d.ts files ---------------------------------
// Maps a global type name (IIoK8sApiCoreV1Probe) to {field: typeRef} where
// typeRef is {ref, array, map} or null (a scalar, or a type we do not walk).
function packageDir(name) {
  return path.dirname(require.resolve(`${name}/package.json`));
}

function walkDts(dir, out) {
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const p = path.join(dir, entry.name);
    if (entry.isDirectory()) {
      if (entry.name !== "_schemas" && entry.name !== "node_modules") walkDts(p, out);
    } else if (entry.name.endsWith(".d.ts")) {
      out.push(p);
    }
  }
  return out;
}

function parseFieldType(text) {
  const t = text.trim().replace(/;$/, "").trim();
  let m;
  if ((m = /^Array<(I\w+)>$/.exec(t))) return { ref: m[1], array: true };
  if ((m = /^\{\s*\[key: string\]:\s*(I\w+);?\s*\}$/s.exec(t))) return { ref: m[1], map: true };
  if (/^\{\s*\[key: string\]:/s.test(t)) return { map: true };
  if ((m = /^(I\w+)$/.exec(t))) return { ref: m[1] };
  return null;
}

function buildInterfaceTable() {
  const table = new Map(); // global name -> Map(field -> typeRef)
  const files = [
    ...walkDts(packageDir("kubernetes-models"), []),
    ...walkDts(packageDir("@kubernetes-models/apimachinery"), []),
  ];
  for (const file of files) {
    const src = readFileSync(file, "utf8");
    const alias = new Map(); // local interface name -> global name
    for (const m of src.matchAll(/export type \{([^}]*)\}/g)) {
      for (const part of m[1].split(",")) {
        const am = /^\s*(\w+)\s+as\s+(\w+)\s*$/.exec(part);
        if (am) alias.set(am[1], am[2]);
      }
    }
    for (const m of src.matchAll(/^export interface (\w+)(?: extends [\w, ]+)? \{\n([\s\S]*?)^\}/gm)) {
      const body = m[2].replace(/\/\*\*[\s\S]*?\*\//g, "");
      const fields = new Map();
      // Fields sit at four spaces; a multi-line type continues at deeper indent.
      for (const fm of body.matchAll(/^ {4}"([^"]+)"\??: ([\s\S]*?;)(?=\n {4}"|\n*$)/gm)) {
        fields.set(fm[1], parseFieldType(fm[2]));
      }
      const local = m[1];
      table.set(alias.get(local) ?? local, fields);
      table.set(`${path.basename(file, ".d.ts")}@${file}`, fields);
    }
  }
  return table;
}

function unknownFields(value, typeName, table, where, errors) {
  const fields = table.get(typeName);
  if (!fields || value === null || typeof value !== "object" || Array.isArray(value)) return;
  for (const [key, child] of Object.entries(value)) {
    if (!fields.has(key)) {
      errors.push(`${where || "/"}: unknown field "${key}"`);
      continue;
    }
    const t = fields.get(key);
    if (!t || !t.ref) continue;
    const at = `${where}/${key}`;
    if (t.array && Array.isArray(child)) {
      child.forEach((item, i) => unknownFields(item, t.ref, table, `${at}/${i}`, errors));
    } else if (t.map && child && typeof child === "object") {
      for (const [k, v] of Object.entries(child)) unknownFields(v, t.ref, table, `${at}/${k}`, errors);
    } else if (!t.array && !t.map) {
      unknownFields(child, t.ref, table, at, errors);
    }
  }
}

// ---- resource rules ----------------------------------------------------------
const QUANTITY_SUFFIX = {
  "": 1, n: 1e-9, u: 1e-6, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
  Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60,
};

// A resource.Quantity ("4Gi", "500m", "1e3", 2) as a number; null if malformed.
function quantity(q) {
  if (typeof q === "number") return q;
  const m = /^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$/.exec(String(q));
  if (!m) return null;
  return Number(m[1]) * (m[2] !== undefined ? 10 ** Number(m[2]) : QUANTITY_SUFFIX[m[3] ?? ""]);
}

const isHugePages = (name) => name.startsWith("hugepages-");
// helper.IsOvercommitAllowed: native (no domain, or *kubernetes.io/) and not hugepages.
const overcommitAllowed = (name) =>
  (!name.includes("/") || name.includes("kubernetes.io/")) && !isHugePages(name);

function resourceRules(resources, where, errors) {
  if (!resources || typeof resources !== "object") return;
  const requests = resources.requests ?? {};
  const limits = resources.limits ?? {};
  for (const [kind, list] of [["requests", requests], ["limits", limits]]) {
    for (const [name, q] of Object.entries(list)) {
      if (quantity(q) === null) errors.push(`${where}/${kind}/${name}: invalid quantity ${JSON.stringify(q)}`);
    }
  }
  for (const [name, q] of Object.entries(requests)) {
    const at = `${where}/requests/${name}`;
    if (name in limits) {
      const req = quantity(q), lim = quantity(limits[name]);
      if (req === null || lim === null) continue;
      if (!overcommitAllowed(name) && req !== lim) {
        errors.push(`${at}: must be equal to ${name} limit of ${limits[name]}`);
      } else if (req > lim) {
        errors.push(`${at}: must be less than or equal to ${name} limit of ${limits[name]}`);
      }
    } else if (!overcommitAllowed(name)) {
      errors.push(`${where}/limits/${name}: Limit must be set for non overcommitable resources`);
    }
  }
  const names = [...Object.keys(requests), ...Object.keys(limits)];
  if (names.some(isHugePages) && !names.some((n) => n === "cpu" || n === "memory")) {
    errors.push(`${where}: HugePages require cpu or memory`);
  }
}

// The pod spec of a Pod, a workload's pod template, or a CronJob's job template.
function podSpecOf(obj) {
  const spec = obj && obj.spec;
  if (!spec || typeof spec !== "object") return null;
  if (obj.kind === "Pod") return { spec, at: "/spec" };
  if (spec.template && spec.template.spec) return { spec: spec.template.spec, at: "/spec/template/spec" };
  const job = spec.jobTemplate && spec.jobTemplate.spec;
  if (job && job.template && job.template.spec) {
    return { spec: job.template.spec, at: "/spec/jobTemplate/spec/template/spec" };
  }
  return null;
}

function podResourceRules(obj, errors) {
  const pod = podSpecOf(obj);
  if (!pod) return;
  for (const list of ["initContainers", "containers"]) {
    const containers = pod.spec[list];
    if (!Array.isArray(containers)) continue;
    containers.forEach((c, i) => resourceRules(c && c.resources, `${pod.at}/${list}/${i}/resources`, errors));
  }
}

// ---- model classes ---------------------------------------------------------
async function modelClass(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return null;
  const spec = `kubernetes-models/${apiVersion}`; // "v1" or "apps/v1", "scheduling.k8s.io/v1"
  try {
    const mod = await import(spec);
    return mod[kind] ?? null;
  } catch {
    return null;
  }
}

function describe(e) {
  if (e && Array.isArray(e.errors)) {
    return e.errors.map((x) => `${x.instancePath || "/"}: ${x.message ?? x.keyword} ${x.params ? JSON.stringify(x.params) : ""}`.trim());
  }
  return [String(e && e.message ? e.message : e)];
}

async function main() {
  let input;
  try {
    input = readFileSync(0, "utf8");
  } catch (e) {
    process.stderr.write(`validate: cannot read stdin: ${e.message}\n`);
    process.exit(2);
  }
  const objects = [];
  for (const doc of parseAllDocuments(input)) {
    if (doc.errors && doc.errors.length) {
      process.stderr.write(`validate: YAML error: ${doc.errors[0].message}\n`);
      process.exit(2);
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) continue;
    if (obj.kind === "List" && Array.isArray(obj.items)) objects.push(...obj.items);
    else objects.push(obj);
  }
  if (objects.length === 0) {
    process.stderr.write("validate: no objects on stdin\n");
    process.exit(2);
  }

  const table = buildInterfaceTable();
  const results = [];
  let status = 0;
  for (const obj of objects) {
    const kind = obj && obj.kind;
    const name = (obj && obj.metadata && obj.metadata.name) || "?";
    const Cls = await modelClass(obj && obj.apiVersion, kind);
    if (!Cls) {
      results.push({ kind, name, ok: false, errors: [`unknown apiVersion/kind ${obj && obj.apiVersion}/${kind}`] });
      status = 2;
      continue;
    }
    const errors = [];
    try {
      new Cls(obj).validate();
    } catch (e) {
      errors.push(...describe(e));
    }
    const group = obj.apiVersion.includes("/") ? obj.apiVersion : `core/${obj.apiVersion}`;
    // Top-level interface: I<Kind> declared in kubernetes-models/<apiVersion>/<Kind>.d.ts.
    const file = path.join(packageDir("kubernetes-models"), obj.apiVersion, `${kind}.d.ts`);
    const top = `${kind}@${file}`;
    if (!table.has(top)) errors.push(`no field list for ${group}/${kind}`);
    else unknownFields(obj, top, table, "", errors);
    podResourceRules(obj, errors);
    results.push({ kind, name, ok: errors.length === 0, errors });
    if (errors.length && status === 0) status = 1;
  }
  for (const r of results) {
    process.stderr.write(`${r.ok ? "ok   " : "FAIL "} ${r.kind}/${r.name}${r.ok ? "" : ": " + r.errors.join("; ")}\n`);
  }
  process.stdout.write(JSON.stringify(results, null, 1) + "\n");
  process.exit(status);
}

main().catch((e) => {
  process.stderr.write(`validate: ${e.stack || e}\n`);
  process.exit(2);
});
