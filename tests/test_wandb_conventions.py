"""W&B conventions, with a fake wandb module: WANDB_PROJECT / WANDB_ENTITY / WANDB_MODE /
WANDB_RUN_GROUP / WANDB_TAGS apply unless the config says otherwise (only what the user
configured is passed), WANDB_MODE=disabled always wins, and a resumed run continues the same
W&B run (id kept in the run directory, resume="allow")."""

import importlib.machinery
import sys

import pytest

from dflash_trainer.config import MetricsConfig
from dflash_trainer.config_io import load_config
from dflash_trainer.observe.sinks import WANDB_ID_FILE, WandbSink, build_sinks
from dflash_trainer.run import train
from tiny import tiny_config, tiny_dataset, tiny_target

ENV = ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_RUN_GROUP", "WANDB_TAGS")


class FakeRun:
    def __init__(self, kw):
        self.kw, self.logged, self.dir, self.id = kw, [], "x", kw.get("id")

    def define_metric(self, *a, **k):
        pass

    def log(self, d):
        self.logged.append(d)

    def finish(self):
        pass


class FakeWandb:
    def __init__(self):
        self.inits = []
        # importlib.util.find_spec("wandb") (transformers/accelerate probe it) needs a spec
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Settings:
        def __init__(self, **kw):
            self.kw = kw

    def init(self, **kw):
        kw.pop("settings")
        self.inits.append(kw)
        return FakeRun(kw)

    def teardown(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    for k in ENV + ("WANDB_RUN_ID", "WANDB_NAME"):
        monkeypatch.delenv(k, raising=False)
    w = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", w)
    return w


def _init(fake, tmp_path, **cfg):
    ms = build_sinks(MetricsConfig(tensorboard=False, console=False, **cfg), tmp_path)
    ms.close()
    return fake.inits[-1] if fake.inits else None


def test_defaults_without_env(fake, tmp_path):
    kw = _init(fake, tmp_path)
    assert kw["mode"] == "offline" and kw["project"] == "dflash-trainer"
    assert kw["reinit"] == "create_new" and kw["resume"] == "allow"
    assert "entity" not in kw and "group" not in kw and "tags" not in kw
    assert kw["id"] == (tmp_path / WANDB_ID_FILE).read_text().strip()


def test_env_wins_over_defaults_and_is_left_to_wandb(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "their-project")
    monkeypatch.setenv("WANDB_ENTITY", "their-team")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-3")
    monkeypatch.setenv("WANDB_TAGS", "a,b")
    kw = _init(fake, tmp_path)
    assert kw["mode"] == "online"
    # wandb reads these from the environment itself: we pass none of them
    for k in ("project", "entity", "group", "tags"):
        assert k not in kw, k


def test_configured_values_win_over_env(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "their-project")
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = load_config(
        None,
        None,
        [
            "--metrics.wandb=offline",
            "--metrics.wandb_project=mine",
            "--metrics.wandb_entity=team",
            "--metrics.wandb_group=g1",
            "--metrics.wandb_tags=x,y",
        ],
    )
    cfg.metrics.tensorboard = cfg.metrics.console = False
    build_sinks(cfg.metrics, tmp_path).close()
    kw = fake.inits[-1]
    assert kw["mode"] == "offline" and kw["project"] == "mine" and kw["entity"] == "team"
    assert kw["group"] == "g1" and kw["tags"] == ["x", "y"]


@pytest.mark.parametrize("configured", ["auto", "online", "offline"])
def test_wandb_mode_disabled_always_wins(fake, tmp_path, monkeypatch, configured):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ms = build_sinks(MetricsConfig(wandb=configured, tensorboard=False, console=False), tmp_path)
    assert not any(isinstance(s, WandbSink) for s in ms.sinks) and fake.inits == []
    ms.close()


def test_user_run_id_is_left_to_wandb(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "chosen")
    kw = _init(fake, tmp_path)
    assert "id" not in kw and "resume" not in kw


def test_a_resumed_run_continues_the_same_wandb_run(fake, tmp_path):
    over = {"metrics.wandb": "offline", "optim.max_steps": 2}
    train(tiny_config(tmp_path, **over), target=tiny_target(), train_set=tiny_dataset())
    over.update({"optim.max_steps": 4, "checkpoint.resume": True})
    train(tiny_config(tmp_path, **over), target=tiny_target(), train_set=tiny_dataset())
    first, second = fake.inits
    assert first["id"] == second["id"] and second["resume"] == "allow"
    assert first["dir"] == second["dir"]
    # a new run (another run_dir, or --overwrite) is another W&B run
    over = {"metrics.wandb": "offline", "optim.max_steps": 2, "overwrite": True}
    train(tiny_config(tmp_path, **over), target=tiny_target(), train_set=tiny_dataset())
    assert fake.inits[-1]["id"] != first["id"]
