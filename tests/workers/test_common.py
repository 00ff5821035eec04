"""ModelSpec carrying a run-trained tokenizer: a worker rebuilds it without the driver's run
directory (a worker on another node need not see it)."""

import pickle
import shutil

from groupflow.config import ModelConfig
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.workers.common import ModelSpec


def test_a_carried_tokenizer_is_rebuilt_after_its_directory_is_gone(tmp_path):
    run_tok = tmp_path / "run" / "tokenizer"
    tok = train_char_tokenizer(["12+34=", "46"])
    tok.save_pretrained(run_tok)
    model = ModelConfig(tiny={"hidden_size": 16, "num_layers": 1, "num_heads": 2})
    spec = pickle.loads(pickle.dumps(ModelSpec.carrying(model, str(run_tok), 0)))
    shutil.rmtree(tmp_path / "run")  # what a worker on another node sees: no run directory
    _, rebuilt = spec.build()
    assert rebuilt.encode("12+34=") == tok.encode("12+34=")
    assert spec.tokenizer_path() != str(run_tok)
    # the written copy is this process's: pickling again does not carry the temp path
    assert pickle.loads(pickle.dumps(spec))._local is None
    # a model's own tokenizer is not carried: read where the model is
    assert ModelSpec(model, str(run_tok), 0).tokenizer_path() == str(run_tok)
