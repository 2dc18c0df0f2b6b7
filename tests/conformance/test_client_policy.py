"""Both clients follow client/policy/client_policy.json: the Python
package's generated weightd/_policy.py and the constants the C++ client was
built with (tests/client_policy_dump prints them, and which codes the C++
retry loop retries) equal the file's values, and the gRPC service config
each hands to gRPC means what the file says: the same read-only methods,
attempts, backoff and codes."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, REPO  # noqa: E402

from weightd import _policy  # noqa: E402  (build/python, put on sys.path by harness)

with open(os.path.join(REPO, "client", "policy", "client_policy.json")) as f:
    POLICY = json.load(f)
RETRY = POLICY["retry"]
SC = POLICY["service_config"]


def _seconds(duration):
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def _check_service_config(text):
    config = json.loads(text)
    assert list(config) == ["methodConfig"] and len(config["methodConfig"]) == 1, config
    method = config["methodConfig"][0]
    assert [(n["service"], n["method"]) for n in method["name"]] == \
        [tuple(m) for m in SC["read_only_methods"]]
    retry = method["retryPolicy"]
    assert retry["maxAttempts"] == SC["max_attempts"]
    assert _seconds(retry["initialBackoff"]) == RETRY["initial_backoff_s"]
    assert _seconds(retry["maxBackoff"]) == RETRY["max_backoff_s"]
    assert retry["backoffMultiplier"] == RETRY["multiplier"]
    assert retry["retryableStatusCodes"] == SC["retryable_status_codes"]


def test_the_policy_keeps_mutating_calls_out_of_grpc_retries():
    """The file itself: only read-only methods, and the codes that mean the
    call never ran."""
    mutating = {("weightd.v1.Models", m) for m in ("Load", "Unload", "BeginPublish",
                                                   "PublishWrite", "CommitPublish")}
    mutating |= {("weightd.v1.Adapters", m) for m in ("Load", "Unload", "Apply")}
    mutating.add(("weightd.v1.Shards", "Release"))
    assert not mutating & {tuple(m) for m in SC["read_only_methods"]}
    assert set(SC["retryable_status_codes"]) <= set(RETRY["codes"])


def test_the_python_client_is_generated_from_the_policy():
    assert _policy.RETRY_CODES == tuple(RETRY["codes"])
    assert _policy.RETRY_INITIAL_BACKOFF == RETRY["initial_backoff_s"]
    assert _policy.RETRY_MULTIPLIER == RETRY["multiplier"]
    assert _policy.RETRY_MAX_BACKOFF == RETRY["max_backoff_s"]
    assert _policy.RETRY_JITTER == RETRY["jitter"]
    assert [tuple(m) for m in _policy.READ_METHODS] == [tuple(m) for m in SC["read_only_methods"]]
    assert _policy.READ_MERGE_GAP == POLICY["read_merge_gap_bytes"]
    assert _policy.MAX_MESSAGE == POLICY["max_message_bytes"]
    _check_service_config(_policy.SERVICE_CONFIG)


def test_the_cpp_client_is_built_from_the_policy():
    out = subprocess.run([os.path.join(BUILD, "tests", "client_policy_dump")],
                         capture_output=True, text=True, check=True).stdout
    cpp = json.loads(out)
    assert cpp["retry_codes"] == RETRY["codes"]
    # What the C++ retry loop retries, asked code by code.
    assert sorted(cpp["retried"]) == sorted(RETRY["codes"])
    assert cpp["initial_backoff_s"] == RETRY["initial_backoff_s"]
    assert cpp["multiplier"] == RETRY["multiplier"]
    assert cpp["max_backoff_s"] == RETRY["max_backoff_s"]
    assert cpp["jitter"] == RETRY["jitter"]
    assert cpp["read_merge_gap"] == POLICY["read_merge_gap_bytes"]
    assert cpp["max_message"] == POLICY["max_message_bytes"]
    _check_service_config(cpp["service_config"])
    # One generator: both clients hand gRPC the very same text.
    assert cpp["service_config"] == _policy.SERVICE_CONFIG


# ---------------------------------------------------------------- the generator

GENERATOR = os.path.join(REPO, "client", "policy", "gen_client_policy.py")


def _generate(tmp_path, policy):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, GENERATOR, "--policy", str(path),
                        "--python", str(out / "_policy.py"), "--cpp", str(out / "policy.inc")],
                       capture_output=True, text=True)
    return r, out


def test_the_build_ships_what_the_generator_writes(tmp_path):
    """build/python/weightd/_policy.py and the C++ .inc are the generator's
    output for the policy file as it is; a rerun leaves both files alone (no
    rebuild of what depends on them)."""
    r, out = _generate(tmp_path, POLICY)
    assert r.returncode == 0, r.stderr
    with open(_policy.__file__) as f:
        assert (out / "_policy.py").read_text() == f.read()
    with open(os.path.join(BUILD, "generated", "client", "client_policy.inc")) as f:
        assert (out / "policy.inc").read_text() == f.read()
    for name in ("_policy.py", "policy.inc"):
        os.utime(out / name, ns=(1, 1))
    r, _ = _generate(tmp_path, POLICY)
    assert r.returncode == 0, r.stderr
    assert os.stat(out / "_policy.py").st_mtime_ns == 1
    assert os.stat(out / "policy.inc").st_mtime_ns == 1


@pytest.mark.parametrize("path,value,field", [
    (("retry", "codes"), None, "retry.codes"),
    (("retry", "codes"), ["UNAVAILABLE", "SOMETIMES"], "retry.codes"),
    (("retry", "codes"), ["OK"], "retry.codes"),
    (("retry", "jitter"), 1.5, "retry.jitter"),
    (("retry", "initial_backoff_s"), "fast", "retry.initial_backoff_s"),
    (("retry", "max_backoff_s"), 0.01, "retry.initial_backoff_s"),
    (("service_config", "read_only_methods"), [["weightd.v1.Models"]], "read_only_methods"),
    (("service_config", "max_attempts"), True, "service_config.max_attempts"),
    (("service_config", "max_attempts"), 6, "service_config.max_attempts"),
    (("service_config", "retryable_status_codes"), [], "retryable_status_codes"),
    (("read_merge_gap_bytes",), None, "read_merge_gap_bytes"),
    (("max_message_bytes",), 2 ** 31, "max_message_bytes"),
])
def test_the_generator_refuses_a_broken_policy(tmp_path, path, value, field):
    """Exit 1, the message naming the field, and nothing written."""
    policy = json.loads(json.dumps(POLICY))
    node = policy
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    r, out = _generate(tmp_path, policy)
    assert r.returncode == 1 and field in r.stderr, r.stderr
    assert not out.exists()
