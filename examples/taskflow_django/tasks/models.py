"""The task, and the e-mails the notification processor sent."""

from django.db import models


class Status(models.TextChoices):  # type: ignore[misc]
    TODO = "TODO"
    IN_PROGRESS = "IN_PROGRESS"
    DONE = "DONE"
    OVERDUE = "OVERDUE"  # set only by the nightly job


OPEN_STATUSES = (Status.TODO, Status.IN_PROGRESS)


class Task(models.Model):  # type: ignore[misc]
    """A task; ``version`` counts its status changes (it names each change's notification)."""

    title = models.CharField(max_length=200)
    owner_email = models.EmailField()
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.TODO)
    due_date = models.DateField(null=True, blank=True)
    version = models.PositiveIntegerField(default=0)


class SentEmail(models.Model):  # type: ignore[misc]
    """One notification e-mail sent by the processor; ``job_id`` is unique, so a job BullMQ
    delivers twice (after a worker crash) is recorded once."""

    job_id = models.CharField(max_length=200, unique=True)
    task = models.ForeignKey(Task, on_delete=models.CASCADE)
    recipient = models.EmailField()
    status = models.CharField(max_length=20)
    attempt = models.PositiveIntegerField()
    sent_at = models.DateTimeField(auto_now_add=True)
