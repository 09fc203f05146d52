"""A local stack started by one run and used by a second (two `heterorl train` in one data
dir) is stopped by the last of them to end, not under the other's feet."""

import heterorl.stack as stack
from pipeline.config import load_config
from pipeline.clients.services import Services


def test_the_last_run_using_a_local_stack_stops_it(tmp_path, monkeypatch):
    running, stopped = {"up": False}, []
    local = Services("127.0.0.1:1", "redis://127.0.0.1:2/0", "http://127.0.0.1:3", "k", "s", "us-east-1",
                     "heterorl", from_local_stack=True)
    monkeypatch.setattr(stack, "resolved_services", lambda cfg, role="admin": local if running["up"] else None)
    monkeypatch.setattr(stack, "start_stack", lambda *a, **k: running.update(up=True))
    monkeypatch.setattr(stack, "stop_stack", lambda data_dir: stopped.append(data_dir) or running.update(up=False))
    cfg = load_config(None, [f"services.data_dir={tmp_path}"], env={})

    first = stack.services_for_run(cfg)
    assert first.__enter__()[2] is True  # started the stack
    second = stack.services_for_run(cfg)
    assert second.__enter__()[2] is False  # found it running
    first.__exit__(None, None, None)
    assert stopped == [] and running["up"]  # the second still uses it
    second.__exit__(None, None, None)
    assert stopped == [str(tmp_path)] and not running["up"]  # the last one out stopped it

    # alone, a run stops what it started; a stack it found (`heterorl up`) is left alone
    with stack.services_for_run(cfg):
        pass
    assert len(stopped) == 2
    running["up"] = True
    with stack.services_for_run(cfg):
        pass
    assert len(stopped) == 2 and running["up"]
