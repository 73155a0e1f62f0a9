"""``sdcore.outbox.celery`` without a broker: the task message Celery would send, and bad config."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery  # type: ignore[import-untyped]
from kombu import entity

from sdcore.outbox import OutboxMessage
from sdcore.outbox.celery import (
    CeleryPublisher,
    MessageTooLargeError,
    TaskLedger,
    exactly_once,
)
from sdcore.outbox.celery._message import task_message
from sdcore.postgres import InvalidIdentifierError

# kombu's entities are untyped: built through Any.
Queue: Any = entity.Queue
Exchange: Any = entity.Exchange

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
JOB_ID = "sd2-" + "ab" * 32


def message(**changes: Any) -> OutboxMessage:
    fields: dict[str, Any] = {
        "id": 1,
        "idempotency_key": "order-1",
        "queue": "emails",
        "name": "emails.send",
        "job_id": JOB_ID,
        "payload": {"to": "ada@example.com", "n": 3, "text": "é✓"},
        "options": {},
        "attempts": 1,
        "max_attempts": 10,
        "created_at": NOW,
    }
    fields.update(changes)
    return OutboxMessage(**fields)


def test_the_message_is_the_one_send_task_builds() -> None:
    app = Celery("compare", set_as_current=False)
    kwargs = {"to": "ada@example.com", "n": 3, "text": "é✓"}
    expected = app.amqp.as_task_v2(JOB_ID, "emails.send", kwargs=kwargs, origin="gen1@host")
    ours = task_message(
        message(payload=kwargs), task="emails.send", origin="gen1@host", now=NOW, max_bytes=10_000
    )
    assert ours.headers == expected.headers
    assert ours.properties == expected.properties
    args, body_kwargs, embed = expected.body
    assert json.loads(ours.body) == [list(args), body_kwargs, embed]
    assert ours.task_id == ours.headers["id"] == ours.headers["root_id"] == JOB_ID


def test_the_delay_option_becomes_an_eta_and_bullmq_options_are_not_sent() -> None:
    options = {"delay": 1500, "attempts": 3, "removeOnComplete": {"age": 60}}
    ours = task_message(message(options=options), task="t", origin="o", now=NOW, max_bytes=10_000)
    assert ours.headers["eta"] == (NOW + timedelta(milliseconds=1500)).isoformat()
    assert "attempts" not in json.dumps(ours.headers)
    assert (
        task_message(message(), task="t", origin="o", now=NOW, max_bytes=10_000).headers["eta"]
        is None
    )


def test_trace_context_travels_in_headers_without_replacing_protocol_ones() -> None:
    carrier = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "id": "spoof"}
    ours = task_message(
        message(trace_context=carrier), task="t", origin="o", now=NOW, max_bytes=10_000
    )
    assert ours.headers["traceparent"] == carrier["traceparent"]
    assert ours.headers["id"] == JOB_ID


def test_a_body_over_the_limit_is_refused_with_its_size() -> None:
    with pytest.raises(MessageTooLargeError, match="more than the 100 allowed") as caught:
        task_message(
            message(payload={"blob": "x" * 200}), task="t", origin="o", now=NOW, max_bytes=100
        )
    assert caught.value.job_id == JOB_ID
    assert caught.value.size > 200


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay"):
        task_message(
            message(options={"delay": -1}), task="t", origin="o", now=NOW, max_bytes=10_000
        )


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("http://127.0.0.1:5672", ValueError, "RabbitMQ .* or Redis"),
        ("memory://", ValueError, "RabbitMQ .* or Redis"),
        ("amqp://", ValueError, "no host"),
        ("amqp://user:s3cret@/vhost", ValueError, "no host"),
        ("", ValueError, "broker_url"),
        (42, TypeError, "broker_url"),
    ],
    ids=["http", "memory", "no-host", "no-host-with-password", "empty", "int"],
)
def test_a_bad_broker_url_is_refused(url: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as caught:
        CeleryPublisher(url)
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"queues": "emails"}, TypeError, "sequence of kombu.Queue"),
        ({"queues": ["emails"]}, TypeError, "kombu.Queue objects"),
        ({"queues": [Queue("a"), Queue("a")]}, ValueError, "'a' twice"),
        (
            {"queues": [Queue("a", Exchange("fan", type="fanout"))]},
            ValueError,
            "direct or topic",
        ),
        ({"task_names": {"a": ""}}, ValueError, "task_names"),
        ({"task_names": [("a", "b")]}, TypeError, "mapping"),
        ({"declare": "yes"}, TypeError, "declare"),
        ({"max_message_bytes": 0}, ValueError, "max_message_bytes"),
        ({"confirm_timeout_s": 0}, ValueError, "confirm_timeout_s"),
    ],
    ids=[
        "queues-str", "queues-names", "queue-twice", "fanout", "empty-task-name",
        "task-names-list", "declare-str", "max-bytes", "confirm-timeout",
    ],
)  # fmt: skip
def test_bad_config_is_refused_naming_it(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        CeleryPublisher("amqp://guest:guest@127.0.0.1:5672//", **kwargs)


async def test_a_closed_publisher_refuses_to_publish() -> None:
    publisher = CeleryPublisher("redis://127.0.0.1:6379/0")
    await publisher.close()
    await publisher.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        await publisher.publish([message()])


def test_ledger_names_are_checked_and_quoted() -> None:
    assert (
        'CREATE TABLE IF NOT EXISTS "app"."done"'
        in TaskLedger(table="done", schema="app").schema_sql()
    )
    with pytest.raises(InvalidIdentifierError, match="table"):
        TaskLedger(table="x" * 64)


def test_exactly_once_refuses_what_cannot_connect_and_runs_only_as_a_task() -> None:
    with pytest.raises(TypeError, match="connect"):
        exactly_once(42)  # type: ignore[arg-type]

    @exactly_once("postgresql://nowhere")
    def effect(conn: Any) -> None:
        raise AssertionError("never runs outside a task")

    with pytest.raises(RuntimeError, match="as a task"):
        effect()


def test_the_extra_is_named_when_kombu_is_missing_and_the_outbox_never_imports_it() -> None:
    code = (
        "import sys\n"
        "import sdcore.outbox, sdcore.queues, sdcore.runtime\n"
        "assert not {'kombu', 'celery'} & set(sys.modules), 'imported without being asked'\n"
        "sys.modules['kombu'] = None\n"
        "try:\n"
        "    import sdcore.outbox.celery\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "pip install 'sdcore[celery]'" in done.stdout
