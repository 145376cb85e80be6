"""Encryption at rest with key rotation; TLS (rediss://) with an ACL user; no secret in logs or events."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from redis import Redis

from agentpool import approve, enqueue_run, get_run, list_runs, wait_for_run
from agentpool.store import crypto
from agentpool.store.codec import pack
from agentpool.store.crypto import Cipher, EncryptionKeyMissing, generate_key
from agentpool.store.errors import UnreadableRecord
from agentpool.store.events import read as read_events
from agentpool.store.keys import RunKeys
from agentpool.testing.localpool import RedisServer

from conftest import TESTS, Pool, script_task, wait_for_status

SECRET_TASK = "Summarize the merger notes for Project Bluebird"
SCRIPT = [
    {
        "tool_calls": [
            {
                "name": "send_email",
                "input": {"to": "cfo@example.com", "subject": "Bluebird terms", "body": "Offer is 41 per share"},
            }
        ]
    },
    {"text": "The Bluebird offer is summarized and sent."},
]
PLAINTEXTS = [b"Bluebird", b"41 per share", b"cfo@example.com", b"email to cfo"]


@pytest.fixture
def key_in_this_process():
    def use(*keys: str) -> None:
        crypto.configure(Cipher(list(keys)) if keys else None)

    yield use
    crypto.configure(None)


def _all_bytes(r: Redis, run_id: str) -> bytes:
    keys = RunKeys.of(run_id)
    blobs = [
        b"".join(k + v for k, v in r.hgetall(keys.run).items()),
        *r.lrange(keys.messages, 0, -1),
        b"".join(k + v for k, v in r.hgetall(keys.ledger).items()),
    ]
    blobs += [str(e).encode() for e in read_events(r, run_id)]
    return b"".join(blobs)


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentpool", *args],
        env=env,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_encrypted_run_is_unreadable_without_its_key_and_readable_with_it(r, pool, model, key_in_this_process):
    key = generate_key()
    model.set_scripts({"secret": SCRIPT})
    key_in_this_process(key)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    run_id = enqueue_run("pool_agents:support", script_task("secret", SECRET_TASK), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed" and "Bluebird" in run.result
    assert run.messages[0]["content"].startswith(SECRET_TASK)
    stored = _all_bytes(r, run_id)
    for text in PLAINTEXTS:
        assert text not in stored, f"{text!r} is stored in clear"

    key_in_this_process()  # no key
    with pytest.raises(EncryptionKeyMissing, match="no AGENTPOOL_ENCRYPTION_KEY"):
        get_run(run_id, connection=r)
    listed = {row.id: row for row in list_runs(connection=r)}
    assert listed[run_id].status == "completed" and listed[run_id].result is None, "listed, content hidden"
    key_in_this_process(generate_key())  # the wrong key
    with pytest.raises(UnreadableRecord, match="encrypted with a key this process does not have"):
        get_run(run_id, connection=r)
    env_without = {k: v for k, v in pool.env.items() if not k.startswith("AGENTPOOL_ENCRYPTION")}
    shown = _cli(env_without, "show", run_id)
    assert shown.returncode == 1 and "no AGENTPOOL_ENCRYPTION_KEY" in shown.stderr and "Bluebird" not in shown.stdout


def test_a_rotated_key_still_reads_old_runs_and_writes_with_the_new_one(r, pool, model, key_in_this_process):
    old, new = generate_key(), generate_key()
    model.set_scripts({"guarded": [{"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]}, {"text": "ok"}]})
    key_in_this_process(old)
    first = pool.start(1, AGENTPOOL_ENCRYPTION_KEY=old)[0]
    run_id = enqueue_run("pool_agents:guarded", script_task("guarded", SECRET_TASK), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    pool.kill(first)

    key_in_this_process(new, old)  # rotation: the new key first, the old one kept for reading
    approve(run_id, connection=r)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=new, AGENTPOOL_ENCRYPTION_OLD_KEYS=old)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed" and run.messages[0]["content"].startswith(SECRET_TASK)
    key_in_this_process(new)  # without the old key, what was written under it is unreadable
    with pytest.raises(UnreadableRecord, match="message 0 is encrypted with a key"):
        get_run(run_id, connection=r)


def _encrypted_run_waiting_to_deploy(r: Redis, pool: Pool, model, key_in_this_process) -> str:
    """A run under encryption at rest, waiting for a person's decision on deploy(version="2.4.1")."""
    key = generate_key()
    model.set_scripts({"ship": [{"tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}]}, {"text": "ok"}]})
    key_in_this_process(key)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    run_id = enqueue_run("pool_agents:guarded", script_task("ship", SECRET_TASK), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    return run_id


def test_input_digests_in_a_redis_dump_cannot_confirm_guesses_when_encryption_is_on(
    r, pool, model, key_in_this_process
):
    run_id = _encrypted_run_waiting_to_deploy(r, pool, model, key_in_this_process)
    keys = RunKeys.of(run_id)
    waiting = b"".join(k + v for k, v in r.hgetall(keys.approvals).items())
    approve(run_id, connection=r)  # checked against the keyed digest of the call's input
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert [e["version"] for e in pool.effects() if e["tool"] == "deploy"] == ["2.4.1"]

    dump = waiting + b"".join(
        k + v for name in (keys.run, keys.ledger, keys.approvals) for k, v in r.hgetall(name).items()
    )
    for guess in ("2.4.1", "2.4.0", "2.5.0"):  # what someone holding the dump would try
        digest = hashlib.sha256(pack({"version": guess})).hexdigest()
        assert digest[:16].encode() not in dump, f"the plain SHA-256 of the input {guess} is in the dump"


def test_a_ledger_intent_recorded_under_the_key_being_rotated_out_still_matches_its_call(
    r, pool, model, key_in_this_process
):
    old, new = generate_key(), generate_key()
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]}, {"text": "Done."}]})
    key_in_this_process(old)
    first = pool.start(1, AGENTPOOL_ENCRYPTION_KEY=old)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow", SECRET_TASK), connection=r)
    pool.wait_for_effect("slow_read")  # its intent is on record, its input digested under the old key
    pool.kill(first)
    key_in_this_process(new, old)  # the rotation: the new key first, the old one kept for reading
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=new, AGENTPOOL_ENCRYPTION_OLD_KEYS=old)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert [e["tool"] for e in pool.effects()] == ["slow_read", "slow_read"], "the intent matched: a read re-runs"


def test_tls_and_an_acl_user_work_and_no_secret_reaches_logs_or_events(tmp_path, model):
    certs = tmp_path / "tls"
    certs.mkdir()
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(certs / "key.pem"),
            "-out",
            str(certs / "cert.pem"),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    password = "pw-Zq81xWv"
    server = RedisServer(
        tmp_path, url=f"rediss://agentpool:{password}@127.0.0.1:{{port}}/0?ssl_ca_certs={certs / 'cert.pem'}"
    )
    server.extra_args = (
        "--port",
        "0",
        "--tls-port",
        str(server.port),
        "--tls-cert-file",
        str(certs / "cert.pem"),
        "--tls-key-file",
        str(certs / "key.pem"),
        "--tls-ca-cert-file",
        str(certs / "cert.pem"),
        "--tls-auth-clients",
        "no",
        "--user",
        "default",
        "off",
        "--user",
        "agentpool",
        "on",
        f">{password}",
        "~*",
        "&*",
        "+@all",
    )
    server.start()
    r = Redis.from_url(server.url)
    pool = Pool(server.url, model, tmp_path)
    try:
        model.set_scripts({"secret": SCRIPT})
        pool.start(1)
        run_id = enqueue_run("pool_agents:support", script_task("secret", SECRET_TASK), connection=r)
        assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
        shown = _cli(pool.env, "show", run_id, "--json")
        assert shown.returncode == 0, shown.stderr
        logs = pool.logs(tail=10**6) + shown.stderr
        events = str(read_events(r, run_id))
        for secret in (password, pool.env["ANTHROPIC_API_KEY"]):
            assert secret not in logs and secret not in events
        assert "rediss://agentpool:***@" in logs, "the worker names its Redis without the password"
        assert f'agentpool.events: {{"run": "{run_id}", "kind": "turn_started"' in logs, (
            "at --log-level INFO every run event is a log line (so the checks above read them too)"
        )
    finally:
        pool.stop()
        server.stop()


def test_messages_sent_to_a_run_are_sealed_while_they_wait_and_once_delivered(r, pool, model, key_in_this_process):
    from agentpool import send_message

    key = generate_key()
    model.set_scripts(
        {"talk": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]}, {"text": "ok"}, {"text": "ok"}]}
    )
    key_in_this_process(key)
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    run_id = enqueue_run("pool_agents:support", script_task("talk"), connection=r)
    pool.wait_for_effect("slow_read")
    keys = RunKeys.of(run_id)
    sent = send_message(run_id, "Bluebird closes at 41 per share", connection=r)
    waiting = b"".join(k + v for k, v in r.hgetall(keys.received).items()) + b"".join(r.lrange(keys.inbox, 0, -1))
    assert r.hexists(keys.received, sent)  # what was captured above holds the message, waiting or delivered
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
    later = send_message(run_id, [{"type": "text", "text": "Tell cfo@example.com"}], connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=later)
    assert run.status == "completed" and "Tell cfo@example.com" in str(run.messages)
    stored = waiting + _all_bytes(r, run_id) + b"".join(k + v for k, v in r.hgetall(keys.received).items())
    for text in PLAINTEXTS:
        assert text not in stored, f"{text!r} is stored in clear"
    key_in_this_process()
    with pytest.raises(EncryptionKeyMissing):
        get_run(run_id, connection=r)


def test_a_denial_reason_is_sealed_like_the_conversation_it_ends_up_in(r, pool, model, key_in_this_process):
    run_id = _encrypted_run_waiting_to_deploy(r, pool, model, key_in_this_process)
    approve(run_id, approved=False, reason="Bluebird freeze until the 41 per share offer closes", connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    denied = [b for m in run.messages if m["role"] == "user" for b in m["content"] if isinstance(b, dict)]
    assert any("Bluebird freeze" in str(b.get("content")) for b in denied), "the model got the reason"
    keys = RunKeys.of(run_id)
    dump = _all_bytes(r, run_id) + b"".join(k + v for k, v in r.hgetall(keys.approvals).items())
    assert not [p for p in PLAINTEXTS if p in dump], [p for p in PLAINTEXTS if p in dump]


def test_an_api_error_that_echoes_the_key_is_stored_logged_and_shown_without_it(r, pool, model):
    """Some gateways answer a refused request with the headers they got: the key must not travel on
    into the run's error, its events, the worker's log or the CLI."""
    key = "sk-test-not-a-secret"  # the key the pool's workers are given (conftest)
    echoed = (
        f"invalid x-api-key {key}; request headers: {{'x-api-key': '{key}', "
        "'Authorization': 'Bearer sk-ant-api03-ANOTHER_SECRET_TOKEN'}"
    )
    model.set_scripts({"echo": [{"error": {"status": 401, "type": "authentication_error", "message": echoed}}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("echo"), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "failed" and "authentication_error" in run.error, run.error
    shown = _cli(pool.env, "show", run_id)
    everywhere = run.error + str(read_events(r, run_id)) + pool.logs(tail=1_000_000) + shown.stdout + shown.stderr
    for secret in (key, "ANOTHER_SECRET_TOKEN"):
        assert secret not in everywhere, secret
