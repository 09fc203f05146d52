"""Shared fixtures.

``local_stack`` (session scope) starts the embedded servers of ``infra.local_stack``
once per test session in a temporary directory and stops them at the end, also when
tests fail or the session is interrupted. Integration tests take it as an argument::

    @pytest.mark.integration
    def test_something(local_stack):
        producer = KafkaProducer(bootstrap_servers=local_stack.kafka_bootstrap)

``local_stack_env`` additionally exports the stack's URLs (KAFKA_BOOTSTRAP_SERVERS,
REDIS_URL, AWS_*, HETERORL_S3_BUCKET) for the duration of one test, for code that
reads its configuration from the environment or for subprocesses.

The stack is the durable one ``heterorl up`` starts (broker log in S3, S3 and Redis
on disk; it starts as fast as the in-memory broker). Set
HETERORL_TEST_KAFKA_STORAGE=memory to run the broker with its log in memory instead.
Nothing here starts a server unless a test asks for the fixture, so
``pytest -m "not integration"`` never touches the network.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading

import pytest

from infra.local_stack import StackError, StackState, stack_env, start_stack, stop_stack


@contextlib.contextmanager
def torch_threads(n: int):
    """Torch's intra-op threads set to `n` inside the block, restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("local-stack")
    storage = os.environ.get("HETERORL_TEST_KAFKA_STORAGE", "s3")
    try:
        state = start_stack(data_dir, kafka_storage=storage, timeout_s=60.0)
    except StackError as exc:
        pytest.fail(f"local stack did not start: {exc}", pytrace=False)
    # Safety nets: the servers run in their own sessions and would outlive pytest if it
    # died before teardown - at interpreter exit, or on SIGTERM (e.g. a CI timeout),
    # which Python does not turn into an exception. Forked children (multiprocessing)
    # inherit both; only this process may stop the stack.
    owner = os.getpid()

    def _stop_if_owner() -> None:
        if os.getpid() == owner:
            stop_stack(data_dir)

    atexit.register(_stop_if_owner)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def _on_sigterm(signum, frame):
            _stop_if_owner()
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield state
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        stop_stack(data_dir)
        atexit.unregister(_stop_if_owner)


@pytest.fixture
def local_stack_env(local_stack: StackState, monkeypatch: pytest.MonkeyPatch) -> StackState:
    for key, value in stack_env(local_stack).items():
        monkeypatch.setenv(key, value)
    return local_stack


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory: pytest.TempPathFactory):
    """A data directory shared by the tests that run the demo config, so its base model is
    warmed up once per session (it is cached in `<data_dir>/models`)."""
    return tmp_path_factory.mktemp("demo-data")
