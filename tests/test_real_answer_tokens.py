"""Greater-than on a real digit tokenizer (SmolLM2-135M: " 1732" is " ", "1", "7", "3", "2"): the task builds,
and its teacher-forced probability difference (valid first digits, then second digits) equals one-prompt
forwards of plain transformers (issue 33, item 5)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.real
def test_greater_than_on_smollm2_equals_plain_transformers_year_by_year(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import entoscope as es
    from entoscope.data import tasks
    from entoscope.data.tokenized import tokenize_data
    from entoscope.evaluate import sequence_metric
    from entoscope.models.adapter import adapt

    folder = smollm2_folder
    a = adapt(es.load_model(str(folder)))
    data = tasks.greater_than(n=2, seed=5, tokenizer=a.tokenizer)
    td = tokenize_data(a, data, answers=True)
    got = sequence_metric(a, td, "prob_diff")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    digit = [tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    for i, e in enumerate(data):
        ids = [tok.bos_token_id] + tok.encode(e.prompt.replace("[[XX:", "").replace("[[YY:", "").replace("]]", ""),
                                              add_special_tokens=False)
        assert ids == td.prompts[i]  # the same prompt, tokenised by transformers
        y1, y2 = divmod(e.meta["yy"], 10)
        with torch.no_grad():
            p1 = hf(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
            p2 = hf(torch.tensor([ids + [digit[y1]]])).logits[0, -1].double().softmax(-1)
        # valid first digits, then second digits after the decade's own (evaluate.py)
        later = sum(float(p1[digit[d]]) for d in range(y1 + 1, 10))
        earlier = sum(float(p1[digit[d]]) for d in range(y1))
        if y2 == 9:
            earlier += float(p1[digit[y1]])
        else:
            later += float(p1[digit[y1]]) * sum(float(p2[digit[d]]) for d in range(y2 + 1, 10))
            earlier += float(p1[digit[y1]]) * sum(float(p2[digit[d]]) for d in range(y2 + 1))
        assert float(got[i]) == pytest.approx(later - earlier, abs=2e-4)
