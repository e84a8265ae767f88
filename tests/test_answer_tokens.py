"""Answers of several tokens (issue 33, item 5): the first-token reading, the teacher-forced sequence reading,
greater-than on a tokenizer with single digits only (as SmolLM2's and Gemma 3's), and the task scores'
intervals and verdicts. Every figure is checked against a computation by hand: one-prompt forwards of the
model, the digits of the start year, the Wilson interval written out."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import entoscope as es
from entoscope.data import tasks
from entoscope.data.examples import Dataset, Example
from entoscope.data.tokenized import tokenize_data
from entoscope.errors import DataError, EntoscopeWarning
from entoscope.models.adapter import adapt

from wilson_by_hand import wilson_by_hand


@pytest.fixture(scope="module")
def demo():
    return adapt(es.load_model("demo"))


@functools.lru_cache(maxsize=1)
def digit_tokenizer_dir() -> str:
    """A small byte-level BPE tokenizer that writes every digit as its own token (like SmolLM2's), trained on
    greater-than sentences so that their words are one token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from entoscope.data.tasks import vocab
    from entoscope.data.tasks.greater_than import TEMPLATES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [t.format(noun=noun, start=1732, century=17) for t in TEMPLATES for noun in vocab.GT_NOUNS]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    folder = tempfile.mkdtemp(prefix="entoscope_digit_tok_")
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def digits():
    """A random tiny Llama whose tokenizer has single digits only."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from entoscope.models.loading import from_hf

    tokenizer = AutoTokenizer.from_pretrained(digit_tokenizer_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, max_position_embeddings=64, vocab_size=len(tokenizer),
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = LlamaForCausalLM(cfg)
    hf.config._attn_implementation = "eager"
    return adapt(from_hf(hf.eval(), tokenizer, name="tiny-digits", folder=digit_tokenizer_dir()))


def _next_logp(a, ids: list[int]) -> torch.Tensor:
    """log P(next token) after `ids`, from one forward of that prompt alone."""
    with torch.no_grad():
        return a.run(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)


def test_an_answer_is_read_by_its_first_token_and_a_shared_first_token_by_neither(demo):
    ids = {w: demo.tokenize(w, prepend_bos=False) for w in (" Paris is nice", " Paris", " Rome", " Berlin")}
    assert len(ids[" Paris is nice"]) > 1 and all(len(ids[w]) == 1 for w in (" Paris", " Rome", " Berlin"))
    paris, rome, berlin = ids[" Paris"][0], ids[" Rome"][0], ids[" Berlin"][0]
    assert ids[" Paris is nice"][0] == paris
    data = Dataset("x", (Example("The capital of France is", answers=(" Paris is nice", " Paris"),
                                 wrong_answers=(" Rome",)),
                         Example("The capital of France is", answers=(" Rome", " Paris is nice"),
                                 wrong_answers=(" Paris", " Berlin"))))
    td = tokenize_data(demo, data, answers=True)  # the default reading: first tokens, each once
    assert td.answers == [[paris], [rome]] and td.wrong_answers == [[rome], [berlin]]
    assert td.answer_seqs[0] == [tuple(ids[" Paris is nice"]), (paris,)]
    with pytest.raises(DataError) as err:
        tokenize_data(demo, data, answers=True, answer_scoring="single")
    assert err.value.code == "multi_token_answer"
    same = Dataset("x", (Example("The capital of France is", answers=(" Paris is nice",),
                                 wrong_answers=(" Paris",)),))
    with pytest.raises(DataError) as err:
        tokenize_data(demo, same, answers=True)
    assert err.value.code == "answer_first_tokens_shared" and "example 0" in str(err.value)


def test_the_sequence_reading_is_the_sum_of_one_prompt_teacher_forced_log_probabilities(demo):
    from entoscope.evaluate import teacher_forced

    data = Dataset("x", (Example("The capital of France is", answers=(" Paris is nice", " Paris")),
                         Example("When Mary and John went to the store, John gave a drink to",
                                 answers=(" Mary",), wrong_answers=(" John and", " Tom"))))
    td = tokenize_data(demo, data, answers=True)
    logp, greedy = teacher_forced(demo, td.prompts, [x + w for x, w in zip(td.answer_seqs, td.wrong_seqs)],
                                  batch_size=2)
    for i, e in enumerate(data):
        prompt = demo.tokenize(e.prompt)
        for text, got in zip(e.answers + e.wrong_answers, logp[i]):
            toks = demo.tokenize(text, prepend_bos=False)
            by_hand = sum(float(_next_logp(demo, prompt + toks[:j])[toks[j]]) for j in range(len(toks)))
            assert got == pytest.approx(by_hand, abs=1e-4), (text, got, by_hand)
    top = int(_next_logp(demo, demo.tokenize(data[1].prompt)).argmax())
    assert greedy[1][0] == (top == demo.tokenize(" Mary", prepend_bos=False)[0])


def test_greater_than_on_a_digit_tokenizer_reads_first_digits_and_whole_years(digits):
    from entoscope.evaluate import sequence_metric
    from entoscope.metrics import at_positions, prob_diff

    data = tasks.greater_than(n=6, seed=3, tokenizer=digits.tokenizer)
    digit = {d: digits.tokenize(str(d), prepend_bos=False)[0] for d in range(10)}
    assert len(set(digit.values())) == 10
    td = tokenize_data(digits, data, answers=True)
    for e, prompt, ans, wrong in zip(data, td.prompts, td.answers, td.wrong_answers):
        yy, century = e.meta["yy"], e.meta["century"]
        assert 10 <= yy <= 89 and prompt[-2:] == [digit[century // 10], digit[century % 10]]
        # the decade's own digit starts years on both sides (neither), unless every year of it is <= YY (YY = x9)
        assert sorted(ans) == sorted(digit[d] for d in range(yy // 10 + 1, 10))
        assert sorted(wrong) == sorted(digit[d] for d in range(yy // 10 + (yy % 10 == 9)))
    with torch.no_grad():
        tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in td.prompts], batch_first=True)
        logits = at_positions(digits.run(tokens).logits, torch.tensor(td.lengths) - 1)
    from entoscope.data.tokenized import pad_answers

    first = prob_diff(logits, pad_answers(td.answers), pad_answers(td.wrong_answers))
    whole = sequence_metric(digits, td, "prob_diff")
    for i, e in enumerate(data):
        yy = e.meta["yy"]
        p1 = _next_logp(digits, td.prompts[i]).exp()
        by_hand_first = sum(p1[digit[d]] for d in range(yy // 10 + 1, 10)) - \
            sum(p1[digit[d]] for d in range(yy // 10 + (yy % 10 == 9)))
        assert float(first[i]) == pytest.approx(float(by_hand_first), abs=1e-5)
        # valid first digits, then second digits after the decade's own: P(d1 > Y1) + P(Y1) P(d2 > Y2 | Y1) ...
        y1, y2 = divmod(yy, 10)
        p2 = _next_logp(digits, td.prompts[i] + [digit[y1]]).exp()
        later = sum(float(p1[digit[d]]) for d in range(y1 + 1, 10))
        earlier = sum(float(p1[digit[d]]) for d in range(y1))
        if y2 == 9:  # ... but every year of the decade is <= YY: its digit counts whole for the earlier years
            earlier += float(p1[digit[y1]])
        else:
            later += float(p1[digit[y1]]) * sum(float(p2[digit[d]]) for d in range(y2 + 1, 10))
            earlier += float(p1[digit[y1]]) * sum(float(p2[digit[d]]) for d in range(y2 + 1))
        assert float(whole[i]) == pytest.approx(later - earlier, abs=1e-6)


def test_task_scores_give_wilson_intervals_and_verdicts_that_follow_them(digits, demo):
    from entoscope.evaluate import task_scores, verdict

    scores = task_scores(digits.module, n=12)
    gt = scores["greater_than"]
    assert "prob_diff_sequence" in gt and gt["n"] == 12.0  # the whole years, read by teacher forcing
    demo_scores = task_scores(demo.module, n=16)
    ioi = demo_scores["ioi"]
    k = round(ioi["accuracy"] * 16)
    low, high = wilson_by_hand(k, 16)
    assert (ioi["accuracy_ci_low"], ioi["accuracy_ci_high"]) == (pytest.approx(low), pytest.approx(high))
    assert "prob_diff_sequence" not in demo_scores["greater_than"]  # one token per answer: nothing more to read
    assert verdict({"accuracy": 0.9, "accuracy_ci_low": 0.81, "accuracy_ci_high": 0.95})["verdict"] == "does well"
    assert verdict({"accuracy": 0.9, "accuracy_ci_low": 0.79, "accuracy_ci_high": 0.95})["verdict"] == "in part"
    assert verdict({"accuracy": 0.3, "accuracy_ci_low": 0.2, "accuracy_ci_high": 0.49})["verdict"] == "does badly"
    assert verdict({"prob_diff": 0.1, "prob_diff_ci_low": 0.05, "prob_diff_ci_high": 0.15,
                    "prob_diff_sequence": 0.7, "prob_diff_sequence_ci_low": 0.6,
                    "prob_diff_sequence_ci_high": 0.8})["verdict"] == "does well"  # judged on whole answers


def test_the_deciding_prefixes_of_two_digit_years_by_hand():
    from entoscope.evaluate import deciding_prefixes

    def years(lo, hi):
        return [divmod(y, 10) for y in range(lo, hi)]

    later, earlier = deciding_prefixes(years(33, 100), years(0, 33))  # start year 32
    assert sorted(later) == [(3, d) for d in range(3, 10)] + [(d,) for d in range(4, 10)]
    assert sorted(earlier) == [(d,) for d in range(3)] + [(3, d) for d in range(3)]
    later, earlier = deciding_prefixes(years(40, 100), years(0, 40))  # start year 39: the 3 decides
    assert sorted(later) == [(d,) for d in range(4, 10)] and sorted(earlier) == [(d,) for d in range(4)]
    with pytest.raises(ValueError):
        deciding_prefixes([(3,)], [(3, 2)])  # "3" is an answer and how a wrong one starts


def test_answers_cut_to_their_first_token_are_counted_in_the_plan_a_warning_and_the_manifest(tmp_path):
    """Answers of several tokens read by their first token (the default) are said, with their count: the count
    is made here with the tokenizer itself (transformers' encode), not by entoscope."""
    model = es.load_model("demo")
    tok = adapt(model).tokenizer
    clean = "When Mary and John went to the store, John gave a drink to"
    answers = [(" Mary is nice",), (" Mary",), (" Mary and",), (" Mary",)]
    data = Dataset("x", tuple(Example(clean, counterfactual=clean.replace("John gave", "Mary gave"), answers=a,
                                      wrong_answers=(" John",)) for a in answers))
    long = sum(len(tok.encode(a[0], add_special_tokens=False)) > 1 for a in answers)
    assert long == 2
    with pytest.warns(EntoscopeWarning, match=r"2 of 8 answers \(in 2 of 4 examples\)"):
        plan = es.Patching().plan(model, data)
    assert any(n.startswith("warning [answer_first_token]: 2 of 8 answers") for n in plan.notes)
    result = es.Patching().run(model, data, quiet=True)
    result.save(tmp_path / "run")
    import json

    saved = json.loads((tmp_path / "run" / "manifest.json").read_text())["warnings"]
    cut = [w for w in saved if w["code"] == "answer_first_token"]
    assert len(cut) == 1 and cut[0]["message"].startswith("2 of 8 answers")
    assert "read as ' Mary'" in cut[0]["message"]
    same = Dataset("x", tuple(Example(clean, counterfactual=clean.replace("John gave", "Mary gave"),
                                      answers=(" Mary",), wrong_answers=(" John",)) for _ in range(4)))
    assert not [n for n in es.Patching().plan(model, same).notes if "answer_first_token" in n]


def test_answers_meant_to_be_read_by_their_first_token_are_not_warned_about(digits):
    """greater-than on a digit tokenizer reads first digits by design (its metric), so the report's own task
    raises no answer_first_token warning; the same answers without the meta key do (two tokens each, counted
    here with the tokenizer itself)."""
    import warnings

    data = tasks.greater_than(n=4, seed=1, tokenizer=digits.tokenizer)
    assert all(len(digits.tokenizer.encode(a, add_special_tokens=False)) == 2 for e in data for a in e.answers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notes = es.Patching().plan(digits, data).notes
    assert not [w for w in caught if "answer_first_token" in str(w.message)]
    assert not [n for n in notes if "answer_first_token" in n]
    plain = Dataset("x", tuple(Example(e.prompt, counterfactual=e.counterfactual, answers=e.answers,
                                       wrong_answers=e.wrong_answers) for e in data))
    total = sum(len(e.answers) + len(e.wrong_answers) for e in data)
    with pytest.warns(EntoscopeWarning, match=rf"{total} of {total} answers \(in 4 of 4 examples\)"):
        es.Patching().plan(digits, plain)


def test_an_answer_written_as_a_special_token_the_tokenizer_lacks_is_refused(demo):
    """'<|unknown|>' is not a token of the demo's tokenizer, which splits it ('<' first): refused, not read as '<'.
    '<|endoftext|>', which it has (its special tokens), is one token and read as itself."""
    tok = demo.tokenizer
    assert len(tok.encode("<|unknown|>", add_special_tokens=False)) > 1
    assert "<|endoftext|>" in tok.all_special_tokens
    bad = Dataset("x", (Example("The capital of France is", answers=("<|unknown|>",), wrong_answers=(" Rome",)),))
    with pytest.raises(DataError) as err:
        tokenize_data(demo, bad, answers=True)
    assert err.value.code == "special_token_answer" and "'<'" in str(err.value) and "<|endoftext|>" in err.value.remedy
    good = Dataset("x", (Example("The capital of France is", answers=("<|endoftext|>",), wrong_answers=(" Rome",)),))
    td = tokenize_data(demo, good, answers=True)
    assert td.answers == [[tok.convert_tokens_to_ids("<|endoftext|>")]]
    plain = Dataset("x", (Example("The capital of France is", answers=(" <div>",), wrong_answers=(" Rome",)),))
    tokenize_data(demo, plain, answers=True)  # markup that is no special token's spelling is text
