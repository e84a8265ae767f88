"""Head scores with a period against targets counted by hand (issue 37: a leading BOS shifts the copies)."""

import numpy as np
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.models import adapt, load_model


def test_a_perfect_induction_head_scores_one_after_a_bos():
    """BOS + 5 tokens + the same 5: the second copy is positions 6..10 and induction query q targets
    q - 4. A planted head that attends exactly there (and to BOS elsewhere) scores 1, not 5/6; a head
    that attends only to BOS has no duplicate-token score (the old code counted query 5 -> BOS)."""
    from entoscope.circuits.head_scores import detection_patterns, period_offsets, score_patterns

    a = adapt(load_model("demo"))
    P, seq = 5, [11, 12, 13, 14, 15]
    data = Dataset("rep", (Example(tuple([a.bos_token_id] + seq + seq)),))
    tokens = torch.tensor([data[0].prompt])
    lengths = torch.tensor([tokens.shape[1]])
    offsets = torch.tensor(period_offsets(a, data, tokens.tolist(), True))
    assert offsets.tolist() == [1]
    T = tokens.shape[1]
    induction = torch.zeros(1, 1, T, T)
    induction[0, 0, :, 0] = 1
    duplicate = induction.clone()
    for q in range(1 + P, 1 + 2 * P):  # the second copy, by hand
        induction[0, 0, q] = 0
        induction[0, 0, q, q - P + 1] = 1
        duplicate[0, 0, q] = 0
        duplicate[0, 0, q, q - P] = 1
    bos_only = torch.zeros(1, 1, T, T)
    bos_only[..., 0] = 1
    det = detection_patterns("induction", tokens, lengths, P, offsets)
    assert det[0].nonzero().tolist() == [[q, q - P + 1] for q in range(1 + P, 1 + 2 * P)]
    assert score_patterns(induction, det, lengths)[0].item() == 1.0
    det = detection_patterns("duplicate_token", tokens, lengths, P, offsets)
    assert score_patterns(duplicate, det, lengths)[0].item() == 1.0
    assert score_patterns(bos_only, det, lengths)[0].item() == 0.0
    # meta offset wins over the BOS rule; a text prompt's prepended BOS adds one to it
    text = Dataset("t", (Example(" a b a b", meta={"offset": 0}), Example((7, 8, 9, 7, 8, 9))))
    prompts = [a.tokenize(e.prompt, prepend_bos=isinstance(e.prompt, str)) for e in text]
    assert period_offsets(a, text, prompts, True) == [1, 0]


def test_period_scores_equal_the_attention_on_second_copy_targets_read_from_the_cache():
    """HeadScores(period=P) on repeated_tokens (BOS first): per head, the mean over prompts of the mean over
    the second copy's queries of the attention on q - P (duplicate) and q - P + 1 (induction), from the
    model's own attention patterns (run_with_cache)."""
    model = load_model("demo")
    a = adapt(model)
    P = 6
    data = es.tasks.repeated_tokens(n=3, seed=2, length=P, bos_token_id=a.bos_token_id)
    table = es.HeadScores(kinds=["duplicate_token", "induction"], period=P).run(model, data, quiet=True).table
    s = a.structure
    for kind, shift in (("duplicate_token", P), ("induction", P - 1)):
        expected = np.zeros((s.n_layers, s.n_heads))
        for ex in data:
            _, cache = model.run_with_cache(torch.tensor([ex.prompt]))
            for L in range(s.n_layers):
                pattern = cache[f"blocks.{L}.attn.hook_pattern"][0]  # [H, T, T]
                q = torch.arange(1 + P, 1 + 2 * P)
                expected[L] += pattern[:, q, q - shift].mean(-1).double().numpy() / len(data)
        got = table[table.kind == kind].sort_values(["layer", "head"]).score.to_numpy().reshape(s.n_layers, -1)
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert expected.max() > 0.5  # the demo has an induction head: the comparison is not of zeros
