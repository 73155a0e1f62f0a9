from sdcore.job_scheduler import JobSchedulerService


async def test_acquire_then_second_contender_loses(jobs: JobSchedulerService) -> None:
    first = await jobs.acquire({"code": "smoke", "run_key": "k"})
    second = await jobs.acquire({"code": "smoke", "run_key": "k"})
    assert first.acquired
    assert not second.acquired
