"""The committed generated code matches proto/generate.proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    for name in ("generate_pb2.py",):
        committed = (ROOT / "proto" / "tgi_proto" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run `make proto`"
