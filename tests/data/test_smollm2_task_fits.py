"""configs/smollm2_arith.yaml's length limits hold for its task in SmolLM2's chat template: a problem that did
not fit would stop the teacher's fine-tune or a run with an error part-way."""

from pathlib import Path

from jopd.data.chat import prompt_response_ids
from jopd.data.pipeline import load_problems
from jopd.models import io
from jopd.run.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2_arith.yaml"


def test_every_heldout_and_early_train_problem_fits_the_config_lengths():
    cfg = load_config(str(CONFIG))
    tok = io.load_tokenizer(cfg.teacher.path)
    heldout, train = load_problems(cfg.data, "heldout"), load_problems(cfg.data, "train")
    longest_prompt = longest_response = 0
    for problem in [*heldout, *(train[i] for i in range(3000))]:
        prompt, response = prompt_response_ids(tok, problem.question, problem.solution, cfg.data.system_prompt)
        longest_prompt, longest_response = max(longest_prompt, len(prompt)), max(longest_response, len(response))
    assert longest_prompt <= cfg.data.max_prompt_len
    assert longest_response <= cfg.data.max_response_len
    assert longest_response <= cfg.sampling.max_new_tokens  # the student can write a whole worked solution
