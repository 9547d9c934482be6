"""`jopd export`: a run's student as an HF directory that transformers loads and generates the same greedy tokens
from as jopd's sampler."""

import numpy as np
import torch
import transformers

from jopd import cli
from jopd.data.chat import user_prompt_ids
from jopd.lab.runs import checkpoint_dir, restore_state, run_config
from jopd.models import io
from jopd.run import loop
from jopd.sampling.greedy import greedy_tokens
from tests.helpers.tiny_testbed import tiny_cache, write_tiny


def test_export_round_trip_through_transformers(tmp_path, capsys):
    cfg_path = write_tiny(tmp_path / "tiny.yaml", train={"steps": 2})
    run_dir = tmp_path / "run"
    assert cli.main(["train", str(cfg_path), f"train.out_dir={run_dir}", f"train.cache_dir={tiny_cache()}"]) == 0
    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "at step 2" in capsys.readouterr().out

    cfg = run_config(run_dir)
    run, _ = loop.build(cfg, log=lambda *_: None)
    state, _ = restore_state(checkpoint_dir(cfg), run.step.abstract_state())
    tok = io.load_tokenizer(out)
    ids = user_prompt_ids(tok, "Bo has 3 figs, gets 5. How many?")
    ours = greedy_tokens(state.params, run.step.student_cfg, ids, 12)  # the trained params, not the export
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False)[0, len(ids):].numpy()
    n = len(ours)
    assert n > 0 and np.array_equal(ours, ref[:n])  # ours stops at EOS (included); transformers too
    bad = cli.main(["export", str(tmp_path / "nope"), "--out", str(out)])
    assert bad == 2
