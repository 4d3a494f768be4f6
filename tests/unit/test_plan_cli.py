"""`lorascope plan` end to end: the CLI (text, --json, errors), the verdict and the ranked
changes, `plan_from_configs` on the configs a recorded run holds, and import hygiene."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorascope.cli import main
from lorascope.plan import PlanInputs, build_plan, plan_from_configs, preset_shape
from lorascope.plan.budget import EDGE, FITS, NO_FIT, compute_budget
from lorascope.plan.lora import LoraSpec
from lorascope.plan.presets import preset_config
from lorascope.plan.training import TrainingSetup, ZeroSetup
from lorascope.units import GIB, parse_bytes

ISSUE_EXAMPLE = [
    "--lora-r",
    "16",
    "--lora-targets",
    "all-linear",
    "--zero",
    "3",
    "--gpus",
    "4",
    "--gpu-mem",
    "80GiB",
    "--seq",
    "4096",
    "--micro-batch",
    "2",
    "--checkpointing",
    "non-reentrant",
]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["plan", *args])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def llama3_8b_config_json(tmp_path: Path) -> Path:
    """A config.json as the Hub ships it (extra keys the plan ignores)."""
    config = {
        **preset_config("llama-3-8b"),
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_issue_example_from_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["--model", str(llama3_8b_config_json(tmp_path)), *ISSUE_EXAMPLE], capsys)
    assert code == 0 and err == ""
    assert "41,943,040 trainable" in out
    for label in (
        "base weights",
        "adapter weights",
        "adapter gradients",
        "optimizer state",
        "master weights",
        "activations",
        "logits + loss",
        "DeepSpeed buckets",
        "NCCL",
        "CUDA context",
        "verdict: fits",
    ):
        assert label in out


def test_json_is_the_same_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--preset", "llama-3-8b", *ISSUE_EXAMPLE, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["params"]["trainable"] == 41_943_040
    assert data["total_bytes"] == sum(t["bytes"] for t in data["terms"] if t["counted"])
    # ZeRO-3 over 4 GPUs: the frozen base is partitioned, 2 bytes per parameter, except the
    # 65 RMSNorm weights (4096 each, under the persistence threshold): whole + their partition.
    base = next(t for t in data["terms"] if t["key"] == "base_weights")
    norms = 65 * 4096
    assert base["bytes"] == round(2 * (8_030_261_248 - norms) / 4 + 2 * norms * (1 + 1 / 4))
    assert data["verdict"] == FITS
    _, text, _ = run_cli(["--preset", "llama-3-8b", *ISSUE_EXAMPLE], capsys)
    assert f"{data['total_bytes'] / GIB:.2f}" in text


def test_70b_preset_ranked_changes_and_combination(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--preset",
        "llama-3-70b",
        "--lora-r",
        "16",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj",
        "--zero",
        "2",
        "--gpus",
        "8",
        "--seq",
        "4096",
        "--json",
    ]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    data = json.loads(out)
    assert data["params"]["trainable"] == 65_536_000
    assert data["verdict"] == NO_FIT
    changes = data["changes"]
    assert changes[0]["label"].startswith("ZeRO-3")
    singles = [c for c in changes if not c["label"].startswith("combined")]
    assert [c["total_bytes"] for c in singles] == sorted(c["total_bytes"] for c in singles)
    combined = changes[-1]
    assert combined["label"].startswith("combined") and combined["verdict"] in (FITS, EDGE)


def test_change_totals_are_full_replans() -> None:
    inputs = PlanInputs(
        preset_shape("llama-3-8b"),
        LoraSpec(r=16, targets="all-linear"),
        TrainingSetup(zero=ZeroSetup(stage=1), gpus_per_node=2, seq=8192, micro_batch=4, attention="eager"),
        gpu_mem=80 * GIB,
    )
    plan = build_plan(inputs)
    by_label = {c.label: c.total for c in plan.changes}
    replans = {
        "ZeRO-3 (partition the frozen base too)": dataclasses.replace(
            inputs.setup, zero=dataclasses.replace(inputs.setup.zero, stage=3)
        ),
        "SDPA attention": dataclasses.replace(inputs.setup, attention="sdpa"),
        "activation checkpointing (non-reentrant)": dataclasses.replace(inputs.setup, checkpointing="non-reentrant"),
    }
    for label, setup in replans.items():
        assert by_label[label] == compute_budget(dataclasses.replace(inputs, setup=setup)).total


def test_verdict_bands() -> None:
    inputs = PlanInputs(preset_shape("mistral-7b"), LoraSpec(), TrainingSetup(seq=1024))
    total = build_plan(inputs).total
    for card, expected in ((int(total * 1.2), FITS), (int(total / 0.95), EDGE), (int(total * 0.9), NO_FIT)):
        assert build_plan(dataclasses.replace(inputs, gpu_mem=card)).verdict == expected


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--model", "/nonexistent/config.json"], 3, "no such file"),
        (["--preset", "llama-3-8b", "--gpu-mem", "lots"], 2, "memory size"),
        (["--preset", "llama-3-8b", "--gpu-mem", "80"], 2, "memory size"),
        ([], 2, "exactly one of --model"),
        (["--preset", "llama-3-8b", "--lora-targets", "nothing_here"], 2, "match no module"),
        (["--preset", "llama-3-8b", "--zero", "1", "--offload-params"], 2, "ZeRO stage 3"),
    ],
)
def test_errors_are_one_line(args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    exit_code, out, err = run_cli(args, capsys)
    assert exit_code == code
    assert out == "" and err.count("\n") == 1 and err.startswith("lorascope: error:") and message in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"hidden_size": 4096}', "lacks intermediate_size"),
        (
            '{"hidden_size": 4096, "intermediate_size": 1, "num_hidden_layers": 2, "num_attention_heads": 3, '
            '"vocab_size": 10}',
            "not divisible",
        ),
        (
            '{"hidden_size": 64, "intermediate_size": 1, "num_hidden_layers": 2, "num_attention_heads": 4, '
            '"vocab_size": 10, "num_local_experts": 8}',
            "mixture-of-experts",
        ),
    ],
)
def test_unusable_config_json(tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    exit_code, _, err = run_cli(["--model", str(path)], capsys)
    assert exit_code == 3 and err.count("\n") == 1 and message in err


def test_ds_and_lora_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": "auto"},
            }
        )
    )
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 64,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "lora_dropout": 0.05,
            }
        )
    )
    code, out, _ = run_cli(
        [
            "--preset",
            "llama-3-8b",
            "--ds-config",
            str(ds),
            "--lora-config",
            str(adapter),
            "--lora-r",
            "16",
            "--gpus",
            "8",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert data["setup"]["zero_stage"] == 3 and data["setup"]["offload_optimizer"]
    assert data["setup"]["micro_batch"] == 2 and data["setup"]["reduce_bucket_size"] == 4096 * 4096
    assert data["lora"]["r"] == 16 and data["lora"]["dropout"] == 0.05
    ds.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    code, _, err = run_cli(["--preset", "llama-3-8b", "--ds-config", str(ds)], capsys)
    assert code == 3 and "stage" in err


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("24576MiB") == 24 * GIB
    assert parse_bytes("1.5T") == int(1.5 * (1 << 40))


def _recorded(value: Any) -> Any:
    """What the probes write: lorascope.probes.session.plain of the live objects."""
    from lorascope.probes.session import plain

    return json.loads(json.dumps(plain(value)))


def test_plan_from_recorded_configs_equals_cli_plan(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    fields = {k: v for k, v in preset_config("tiny-llama").items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model_config = _recorded(model.base_model.model.config.to_dict())
    lora_config = _recorded({name: c.to_dict() for name, c in model.peft_config.items()})
    ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    plan = plan_from_configs(model_config, lora_config, ds_config, world_size=2, seq=32)
    assert plan.params.trainable == model.get_nb_trainable_parameters()[0]
    code, out, _ = run_cli(
        [
            "--preset",
            "tiny-llama",
            "--lora-r",
            "8",
            "--lora-alpha",
            "16",
            "--lora-targets",
            "all-linear",
            "--zero",
            "3",
            "--gpus",
            "2",
            "--seq",
            "32",
            "--micro-batch",
            "4",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    cli_terms = {t["key"]: t["bytes"] for t in json.loads(out)["terms"]}
    assert {t.key: t.bytes for t in plan.terms} == cli_terms


def test_plan_from_configs_precision_rules() -> None:
    model = {**preset_config("llama-3-8b"), "dtype": "bfloat16"}
    lora = {"peft_type": "LORA", "r": 16, "target_modules": "all-linear"}
    no_ds = plan_from_configs(model, lora, None, world_size=1, seq=2048, micro_batch=1)
    assert no_ds.inputs.setup.precision == "bf16" and no_ds.inputs.setup.fp32_adapters
    assert no_ds.term("master_weights").bytes == 0  # fp32 adapters are their own master
    ds_bf16 = plan_from_configs(
        model, lora, {"bf16": {"enabled": True}}, world_size=8, seq=2048, micro_batch=1, gpus_per_node=4
    )
    assert not ds_bf16.inputs.setup.fp32_adapters and ds_bf16.inputs.setup.nodes == 2
    qlora = {**model, "quantization_config": {"load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16"}}
    assert plan_from_configs(qlora, lora, None, world_size=1, seq=512, micro_batch=1).inputs.setup.precision == "4bit"


def test_no_torch_at_import() -> None:
    code = (
        "import sys, lorascope.plan, lorascope.cli.plan, lorascope.cli; "
        "bad = [m for m in ('torch', 'transformers', 'peft', 'deepspeed') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
