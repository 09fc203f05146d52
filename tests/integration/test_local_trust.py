"""The run's own samplers and everyone else's, as the learner tells them apart: keys
`provision_local` registers in Redis (local, or not with `local=False`, as `heterorl loadtest`
registers its samplers), read back by the learner's intake (`Intake.trusted`:
a group whose log-probs are not re-scored; `Intake.all_trusted`: no version needs keeping)."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from consumers.intake import Intake
from heterorl.keys import provision_local
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import require_services
from pipeline.config import load_config
from pipeline.records.metrics import StageClock
from pipeline.trust.keyring import key_paths, load_root_public, read_registry
from pipeline.wire.signing import read_key_file
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration


def run_config(tmp_path: Path, run: str, *more: str):
    return load_config(None, [f"run.name={run}", f"services.data_dir={tmp_path}", "security.registry_refresh_s=0.01",
                              *more])


def intake_of(cfg) -> Intake:
    """The learner's intake of `cfg`'s run, its registry read from Redis now."""
    client = connect_redis(require_services(cfg.services).redis_url)
    return Intake.open(cfg, None, state=RunState(client, cfg.run.name), store=None, keys=key_paths(cfg),
                       tokenizer=None, policy=lambda: None, model_dir=Path("."), work_dir=Path("."), device="cpu",
                       reach=3, clock=StageClock(), dead_letter=lambda *a: None, fresh_in_step=True,
                       screen=SimpleNamespace())


def group_of(cfg, sampler_id: str):
    """A group signed by `sampler_id`'s key (the key id is what the intake judges it by)."""
    key = read_key_file(key_paths(cfg).role_key(sampler_id, "sampler"))
    return make_rollout(run=cfg.run.name, key_id=key.key_id, sampler_id=sampler_id)


def test_keys_provisioned_as_not_local_are_not_trusted_and_the_learner_sees_it(local_stack_env, tmp_path):
    cfg = run_config(tmp_path, f"local-trust-{int(time.time() * 1000)}")
    client = connect_redis(require_services(cfg.services).redis_url)
    provision_local(cfg, client, ["own-1", "own-2"])  # what `heterorl train` does for its samplers
    registry = read_registry(client, cfg.run.name, load_root_public(key_paths(cfg)))
    own = {read_key_file(key_paths(cfg).role_key(s, "sampler")).key_id for s in ("own-1", "own-2")}
    assert {k for k in registry.keys if registry.is_local(k)} == own
    intake = intake_of(cfg)
    assert intake.trusted(group_of(cfg, "own-1")) and intake.trusted(group_of(cfg, "own-2"))
    assert intake.all_trusted()  # only the run's own: nothing to keep for re-scoring

    provision_local(cfg, client, ["remote-1"], local=False)  # as `heterorl loadtest` registers its samplers
    registry = read_registry(client, cfg.run.name, load_root_public(key_paths(cfg)))
    remote = read_key_file(key_paths(cfg).role_key("remote-1", "sampler")).key_id
    assert registry.keys[remote].status == "active" and not registry.is_local(remote)
    assert not registry.keys[remote].local
    time.sleep(0.05)
    intake.refresh_registry()  # the learner's next read of the registry (security.registry_refresh_s)
    assert not intake.trusted(group_of(cfg, "remote-1")) and intake.trusted(group_of(cfg, "own-1"))
    assert not intake.all_trusted()  # an active key not the run's own: versions are kept again
    assert not intake_of(cfg).all_trusted()  # as a learner started now reads it

    audit = intake_of(run_config(tmp_path, cfg.run.name, "security.trust_local_samplers=false"))
    assert not any(audit.trusted(group_of(cfg, s)) for s in ("own-1", "own-2", "remote-1"))
    assert not audit.all_trusted()


def test_a_sampler_re_provisioned_as_not_local_gets_a_fresh_key_that_is_not_trusted(local_stack_env, tmp_path):
    """One sampler id registered first as the run's own, then with `local=False`: a new key is
    minted and registered for it, not the run's own, and the learner stops counting on all keys
    being local."""
    cfg = run_config(tmp_path, f"local-trust-{int(time.time() * 1000)}")
    client = connect_redis(require_services(cfg.services).redis_url)
    provision_local(cfg, client, ["box-1"])
    first = group_of(cfg, "box-1")
    intake = intake_of(cfg)
    assert intake.trusted(first) and intake.all_trusted()
    provision_local(cfg, client, ["box-1"], local=False)
    second = group_of(cfg, "box-1")
    assert second.key_id != first.key_id
    time.sleep(0.05)
    intake.refresh_registry()
    assert not intake.trusted(second) and not intake.all_trusted()
