"""The root of every error sdcore raises, and the tree under it.

Every public error is an :class:`SdcoreError` *and* a subclass of the builtin that fits it, so
``except ValueError`` keeps working where it always did, and ``except SdcoreError`` catches
anything sdcore raised on purpose. Driver errors (psycopg, redis) are wrapped at the adapter
boundary (``raise … from exc``); the original stays in ``__cause__``::

    SdcoreError
    ├── JobSchedulerError                       sdcore.job_scheduler
    │   ├── LostJobLeaseError
    │   ├── InvalidJobLeaseOptionsError         (ValueError)
    │   ├── InvalidJobIdentityOptionsError      (ValueError)
    │   ├── InvalidAdminRequestError            (ValueError)
    │   ├── JobNotFoundError                    (LookupError)
    │   ├── JobNotRunningError
    │   ├── JobSchedulerUnavailableError        (ConnectionError)
    │   ├── JobSchedulerDatabaseError           (.sqlstate)
    │   └── ReadOnlyJobRecordError              (RuntimeError; sdcore.sqlalchemy)
    ├── SchedulingError                         sdcore.scheduling
    │   ├── InvalidScheduleError                (ValueError)
    │   ├── ScheduleNotFoundError               (KeyError)
    │   ├── ScheduleControlError                (ValueError; the control plane)
    │   └── ControlWriteUncertainError          (ConnectionError; may have been recorded)
    ├── EventError                              sdcore.events
    │   ├── InvalidEventNameError               (ValueError)
    │   ├── InvalidListenerError                (TypeError)
    │   ├── UnknownEventError                   (LookupError)
    │   └── EventLoopRequiredError              (RuntimeError)
    ├── OutboxError                             sdcore.outbox
    │   ├── InvalidOutboxMessageError           (ValueError)
    │   ├── InvalidOutboxRequestError           (ValueError; OutboxAdmin)
    │   ├── OutboxKeyConflictError              (ValueError)
    │   ├── DuplicateOutboxKeyError             (ValueError)
    │   ├── OutboxTransactionRequiredError      (RuntimeError)
    │   ├── OutboxDatabaseError                 (ConnectionError; .sqlstate)
    │   └── PublisherUnavailableError           (ConnectionError)
    ├── QueuesError                             sdcore.queues
    │   ├── RedisClientError                    (ValueError)
    │   ├── RedisUnavailableError               (ConnectionError)
    │   ├── JobTooLargeError                    (ValueError)
    │   ├── JobRejectedError                    (RuntimeError)
    │   └── InvalidProcessorError               (ValueError)
    ├── AlertingError                           sdcore.alerting
    │   ├── InvalidAlertingConfigError          (ValueError)
    │   └── WebhookSignatureError               (ValueError; verify_webhook)
    ├── InvalidIdentifierError                  (ValueError; sdcore.postgres)
    ├── DatabaseConnectError                    (ConnectionError; sdcore.postgres: .reason)
    ├── MigrationError                          (RuntimeError; sdcore.postgres)
    ├── JsonValueError / JsonTypeError          (ValueError / TypeError; job data, payloads)
    ├── EmbeddedUnavailableError                (RuntimeError; sdcore.demo)
    └── RuntimeStateError                       (RuntimeError; sdcore.runtime)

A test (``tests/unit/test_errors.py``) checks that every public error class of every package is
under :class:`SdcoreError`.
"""

from __future__ import annotations

__all__ = ["SdcoreError"]


class SdcoreError(Exception):
    """Base class of every error sdcore raises on purpose."""
