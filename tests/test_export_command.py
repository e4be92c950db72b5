"""`dflash-trainer export CHECKPOINT_DIR --export.out=DIR`: published format + training.json
(target, training config), loadable by the `dflash` reference package; `eval --drafter DIR` needs no
preset."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.cli import main
from dflash_trainer.models.export import expected_names, load_drafter
from test_bad_input import GOOD, _train, model_dir  # noqa: F401  (model_dir: a fixture)


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("export_run")
    data = tmp / "d.jsonl"
    data.write_text("\n".join([json.dumps(GOOD)] * 8) + "\n")
    assert _train(model_dir, tmp, f"--data.sources={data}") == 0
    return tmp / "run"


def test_export_a_checkpoint_records_target_and_config(trained, model_dir, tmp_path, capsys):  # noqa: F811
    (ck,) = sorted((trained / "checkpoints").glob("step-*"))
    out = tmp_path / "drafter"
    assert main(["export", str(ck), f"--export.out={out}"]) == 0
    printed = capsys.readouterr().out
    assert f"exported step 2 of {ck.resolve()} to {out}" in printed
    assert f"dflash-trainer eval --drafter {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "training.json",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(expected_names(1))
    rec = json.loads((out / "training.json").read_text())
    assert rec["format"] == 1 and rec["step"] == 2 and rec["checkpoint"] == str(ck.resolve())
    assert rec["target"]["model"] == str(model_dir)
    assert rec["target"]["local_dir"] == str(model_dir.resolve())
    assert rec["config"]["objective"]["num_anchors"] == 4
    assert rec["config"]["run_dir"] == str(trained)
    # same weights as the checkpoint's own export
    a, b = load_drafter(out), load_drafter(ck / "export")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_reference_package_loads_the_export(trained, tmp_path):
    dflash_model = pytest.importorskip("dflash.model")
    out = tmp_path / "drafter"
    assert main(["export", str(trained), f"--export.out={out}"]) == 0  # a run dir: its latest
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    ours = load_drafter(out)
    assert ref.block_size == ours.config.block_size
    assert list(ref.target_layer_ids) == list(ours.config.target_layer_ids)
    assert ours.state_dict()["fc.weight"].dtype == torch.bfloat16  # the default export dtype
    assert torch.equal(ref.fc.weight, ours.state_dict()["fc.weight"].float())


def test_dtype_and_refusals(trained, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert (
        main(
            [
                "export",
                str(trained / "checkpoints"),
                f"--export.out={out}",
                "--export.dtype=bfloat16",
            ]
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # re-exporting over an export is fine; over anything else is refused, untouched
    assert main(["export", str(trained), f"--export.out={out}"]) == 0
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(trained), f"--export.out={other}"]) == 2
    assert "is not an export" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"
    assert main(["export", str(tmp_path / "nothing"), f"--export.out={tmp_path / 'x'}"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    # the trainer's own exports carry training.json too
    assert json.loads((trained / "export" / "training.json").read_text())["step"] == 2


def test_eval_on_an_export_needs_no_preset(trained, model_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "drafter"
    assert main(["export", str(trained), f"--export.out={out}"]) == 0
    prompts = tmp_path / "p.jsonl"
    msgs = [{"role": "user", "content": "Hello how is it going ?"}]
    prompts.write_text(json.dumps({"id": "a", "messages": msgs}) + "\n")
    result = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            "--drafter",
            str(out),
            "--output",
            str(result),
            f"--eval.datasets=[{prompts}]",
            "--eval.max_new_tokens=6",
            "--eval.dataset_prompts=1",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    payload = json.loads(result.read_text())
    assert payload["target"] == str(model_dir) or str(model_dir) in payload["target"]
    assert payload["block_size"] == 4
    assert payload["datasets"] and all(k.startswith(str(prompts)) for k in payload["datasets"])


def test_export_accepts_the_run_dir_and_the_latest_pointer(trained, tmp_path):
    """What users type: the run directory, its checkpoints/ and checkpoints/latest (a pointer
    file) all mean the newest checkpoint."""
    (ck,) = sorted((trained / "checkpoints").glob("step-*"))
    want = load_file(str(ck / "export" / "model.safetensors"))
    for i, src in enumerate((trained, trained / "checkpoints", trained / "checkpoints" / "latest")):
        out = tmp_path / f"d{i}"
        assert main(["export", str(src), f"--export.out={out}"]) == 0
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k])
