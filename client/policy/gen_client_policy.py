#!/usr/bin/env python3
"""Writes the rules both weightd clients follow from client_policy.json.

  gen_client_policy.py [--policy client_policy.json] [--cpp OUT.inc] [--python OUT]

--cpp: C++ constants (client/client_policy.h includes the file inside
namespace weightd): kRetryCodes, kRetryInitialBackoffS, kRetryMultiplier,
kRetryMaxBackoffS, kRetryJitter, kServiceConfig, kReadMergeGap,
kMaxMessageBytes.
--python: the module weightd/_policy.py: RETRY_CODES, RETRY_INITIAL_BACKOFF,
RETRY_MULTIPLIER, RETRY_MAX_BACKOFF, RETRY_JITTER, READ_METHODS,
SERVICE_CONFIG, READ_MERGE_GAP, MAX_MESSAGE.

A policy that lacks a field or holds a value of the wrong kind or range is
refused (exit 1, the message naming the field) and nothing is written. A
file is rewritten only when its text changes, so a rerun does not make
what is built from it stale. client/CMakeLists.txt runs it at build time
(build/generated/client/client_policy.inc, build/python/weightd/_policy.py);
tests/conformance/test_client_policy.py checks both clients against the
JSON. --json is an older spelling of --policy.
"""
import argparse
import json
import os
import sys

# gRPC's status code names (grpc/status.h, absl::StatusCode).
CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
         "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
         "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
         "UNAUTHENTICATED"]


class PolicyError(Exception):
    pass


def _field(obj, path, kind):
    """obj[path...] checked to be of `kind` (a type or tuple of types; a
    bool is never a number here)."""
    value = obj
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise PolicyError("missing field %s" % ".".join(path))
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise PolicyError("field %s: expected %s, got %r" % (".".join(path), kind, value))
    return value


def _codes(policy, path):
    codes = _field(policy, path, list)
    if not codes or any(not isinstance(c, str) or c not in CODES or c == "OK" for c in codes):
        raise PolicyError("field %s: expected gRPC status code names, got %r"
                          % (".".join(path), codes))
    return codes


def load(path):
    """The policy file, checked: every value present, of its kind and in its
    range (a message naming the field otherwise)."""
    with open(path) as f:
        p = json.load(f)
    number = (int, float)
    retry = {
        "codes": _codes(p, ("retry", "codes")),
        "initial_backoff_s": _field(p, ("retry", "initial_backoff_s"), number),
        "multiplier": _field(p, ("retry", "multiplier"), number),
        "max_backoff_s": _field(p, ("retry", "max_backoff_s"), number),
        "jitter": _field(p, ("retry", "jitter"), number),
    }
    methods = _field(p, ("service_config", "read_only_methods"), list)
    if not methods or any(not isinstance(m, list) or len(m) != 2 or
                          not all(isinstance(x, str) and x for x in m) for m in methods):
        raise PolicyError("field service_config.read_only_methods: expected "
                          "[service, method] pairs, got %r" % (methods,))
    sc = {
        "read_only_methods": methods,
        "max_attempts": _field(p, ("service_config", "max_attempts"), int),
        "retryable_status_codes": _codes(p, ("service_config", "retryable_status_codes")),
    }
    out = {"retry": retry, "service_config": sc}
    for key in ("read_merge_gap_bytes", "max_message_bytes"):
        out[key] = _field(p, (key,), int)
        if not 0 <= out[key] < 2 ** 31:
            raise PolicyError("field %s: expected an integer in [0, 2^31)" % key)
    if not 0 < retry["initial_backoff_s"] <= retry["max_backoff_s"]:
        raise PolicyError("field retry.initial_backoff_s: expected 0 < initial_backoff_s "
                          "<= max_backoff_s")
    if retry["multiplier"] < 1:
        raise PolicyError("field retry.multiplier: expected >= 1")
    if not 0 <= retry["jitter"] < 1:
        raise PolicyError("field retry.jitter: expected a fraction in [0, 1)")
    if not 2 <= sc["max_attempts"] <= 5:
        raise PolicyError("field service_config.max_attempts: expected 2..5 (gRPC's range)")
    if out["max_message_bytes"] == 0:
        raise PolicyError("field max_message_bytes: expected > 0")
    return out


def seconds(value):
    """A protobuf Duration string as gRPC's service config takes it."""
    return "%gs" % value


def service_config(p):
    """The gRPC service config (JSON text) of the read-only methods: gRPC's
    own retries, with the client's backoff."""
    retry, sc = p["retry"], p["service_config"]
    config = {"methodConfig": [{
        "name": [{"service": s, "method": m} for s, m in sc["read_only_methods"]],
        "retryPolicy": {
            "maxAttempts": sc["max_attempts"],
            "initialBackoff": seconds(retry["initial_backoff_s"]),
            "maxBackoff": seconds(retry["max_backoff_s"]),
            "backoffMultiplier": retry["multiplier"],
            "retryableStatusCodes": list(sc["retryable_status_codes"]),
        }}]}
    return json.dumps(config, separators=(",", ":"))


def absl_code(name):
    return "absl::StatusCode::k" + "".join(w.capitalize() for w in name.split("_"))


def cpp_double(value):
    return repr(float(value))


def cpp(p, source):
    retry = p["retry"]
    config = service_config(p)
    if ")wd\"" in config:
        raise PolicyError("the service config cannot be a raw string literal")
    codes = ", ".join(absl_code(c) for c in retry["codes"])
    return "\n".join([
        "// Generated by client/policy/gen_client_policy.py from %s: do not edit." % source,
        "// Included by client/client_policy.h inside namespace weightd.",
        "",
        "// Calls failing with these codes are retried (client/retry.h), with",
        "// exponential backoff and +-jitter, within the client's retry deadline.",
        "inline constexpr absl::StatusCode kRetryCodes[] = {%s};" % codes,
        "inline constexpr double kRetryInitialBackoffS = %s;" % cpp_double(retry["initial_backoff_s"]),
        "inline constexpr double kRetryMultiplier = %s;" % cpp_double(retry["multiplier"]),
        "inline constexpr double kRetryMaxBackoffS = %s;" % cpp_double(retry["max_backoff_s"]),
        "inline constexpr double kRetryJitter = %s;" % cpp_double(retry["jitter"]),
        "// gRPC's own retries of the read-only methods (the service config).",
        "inline constexpr char kServiceConfig[] = R\"wd(%s)wd\";" % config,
        "// grpc transport: tensor ranges closer than this are read as one.",
        "inline constexpr uint64_t kReadMergeGap = %d;" % p["read_merge_gap_bytes"],
        "// The largest message the client receives.",
        "inline constexpr int kMaxMessageBytes = %d;" % p["max_message_bytes"],
        "",
    ])


def python(p, source):
    retry, sc = p["retry"], p["service_config"]
    lines = [
        '"""The rules the weightd clients share: retry codes and backoff, the',
        "read-only methods and gRPC's service config, read coalescing, the",
        "largest message.",
        "",
        "Generated by client/policy/gen_client_policy.py from %s:" % source,
        'do not edit."""',
        "",
        "RETRY_CODES = %r" % (tuple(retry["codes"]),),
        "RETRY_INITIAL_BACKOFF = %r" % float(retry["initial_backoff_s"]),
        "RETRY_MULTIPLIER = %r" % float(retry["multiplier"]),
        "RETRY_MAX_BACKOFF = %r" % float(retry["max_backoff_s"]),
        "RETRY_JITTER = %r" % float(retry["jitter"]),
        "READ_METHODS = %r" % [tuple(m) for m in sc["read_only_methods"]],
        "SERVICE_CONFIG = %r" % service_config(p),
        "READ_MERGE_GAP = %d" % p["read_merge_gap_bytes"],
        "MAX_MESSAGE = %d" % p["max_message_bytes"],
        "",
    ]
    return "\n".join(lines)


def write(path, text):
    """Writes `text` to `path` unless it holds it already (a rerun leaves
    the file, and what the build makes from it, alone)."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", "--json", dest="policy",
                    default=os.path.join(here, "client_policy.json"),
                    help="the policy file (default: client_policy.json beside this script)")
    ap.add_argument("--cpp", help="write the C++ constants (.inc) here")
    ap.add_argument("--python", help="write weightd/_policy.py here")
    args = ap.parse_args(argv)
    try:
        p = load(args.policy)
    except (OSError, ValueError, PolicyError) as e:
        print("gen_client_policy: %s: %s" % (args.policy, e), file=sys.stderr)
        return 1
    source = "client/policy/client_policy.json"
    if args.cpp:
        write(args.cpp, cpp(p, source))
    if args.python:
        write(args.python, python(p, source))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
