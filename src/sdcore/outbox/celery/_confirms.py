"""The publisher confirms one batch waits for, on a RabbitMQ channel in confirm mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from sdcore.outbox.celery._config import BrokerRefusedError


@dataclass(slots=True)
class Confirms:
    """What a batch published on a confirm channel still waits for, and what came back.

    ``results`` is the batch's result list (one slot per message): a nack or a return fills the
    message's slot with a :class:`BrokerRefusedError`; an ack leaves it ``None``.
    """

    results: list[BaseException | None]
    by_tag: dict[int, int] = field(default_factory=dict)
    """Delivery tag → the message's index in the batch, until its confirm comes."""
    by_id: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Task id → index and queue name (a returned message names its correlation id)."""
    ids: dict[int, str] = field(default_factory=dict)
    """Index → task id."""
    acked: set[int] = field(default_factory=set)
    """Indexes the broker confirmed."""

    def sent(self, tag: int, index: int, task_id: str, queue: str) -> None:
        """Wait for the confirm of the message at ``index``, published under ``tag``."""
        self.by_tag[tag] = index
        self.by_id[task_id] = (index, queue)
        self.ids[index] = task_id

    def settle(self, delivery_tag: int, multiple: bool, error: str | None) -> None:
        """An ack (``error`` is ``None``) or a nack of ``delivery_tag`` (and all before it if
        ``multiple``)."""
        tags = [t for t in self.by_tag if t <= delivery_tag] if multiple else [delivery_tag]
        for tag in tags:
            index = self.by_tag.pop(tag, None)
            if index is None:
                continue
            if error is None:
                self.acked.add(index)
            elif self.results[index] is None:
                self.results[index] = BrokerRefusedError(self.ids[index], error)

    def returned(self, task_id: object, reason: str) -> str | None:
        """A message the broker returned (its confirm follows); return its queue, if ours."""
        if not isinstance(task_id, str) or task_id not in self.by_id:
            return None
        index, queue = self.by_id[task_id]
        self.results[index] = BrokerRefusedError(task_id, reason)
        return queue
