"""HFEngine's caching: per-row reuse across calls, shared-prompt prefill, compaction.

Every optimisation must leave the sampled distribution and the reported log-probabilities
unchanged: logprobs are checked against one full forward pass over prompt + reply, and greedy
replies against the engine with the optimisation switched off.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from turnrl.algorithms.losses import token_logprobs
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.hf import _Kept, _KeptRows, _sample

TEMPERATURE = 0.7


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def recomputed(model, prompt, completion, temperature=TEMPERATURE):
    ids = torch.tensor([list(prompt) + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], temperature)[0, len(prompt) - 1:]


def assert_logprobs_match(model, prompts, completions, temperature=TEMPERATURE):
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(completion.token_ids) == len(completion.logprobs) > 0
        expected = recomputed(model, prompt, completion, temperature)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


class PrefillSpy:
    """Records, of the engine's forward passes (those with a cache), the (rows, width) of every
    prefill in ``shapes`` and the rows of every one-token decode step in ``decode_rows``."""

    def __init__(self, model):
        self.shapes, self.decode_rows = [], []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if kwargs.get("cache", kwargs.get("past_key_values")) is None:
            return  # a test's own forward pass (the cache keyword is transformers' choice)
        rows, width = kwargs["input_ids"].shape
        if width > 1:
            self.shapes.append((rows, width))
        else:
            self.decode_rows.append(rows)


def continue_(prompt, completion, tok, text=" ok?"):
    """The next turn's prompt: prompt + reply + an environment message."""
    return list(prompt) + completion.token_ids + encode(tok, text)


def interleaved_calls(engine, tok, params):
    """Three calls over changing row subsets: continued rows, brand-new rows, and a row that
    skips a call (kept meanwhile). Returns every call's (prompts, completions)."""
    a, b, c = encode(tok, "Say a digit."), encode(tok, "Hi"), encode(tok, "Count: 1 2 3")
    first = [a, b, c]
    out1 = engine.generate(first, params)
    second = [continue_(b, out1[1], tok), encode(tok, "New one"), continue_(a, out1[0], tok)]
    out2 = engine.generate(second, params)
    # c skipped the second call; the new row of call 2 and b go on; d is brand new.
    third = [continue_(c, out1[2], tok, " again"), continue_(second[0], out2[0], tok),
             encode(tok, "d"), continue_(second[1], out2[1], tok)]
    out3 = engine.generate(third, params)
    return [(first, out1), (second, out2), (third, out3)]


def test_interleaved_rows_reuse_their_own_cache_and_match_a_forward_pass(tiny):
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE)
    starts, generate = [], engine.generate

    def marked(prompts, params):  # where each call's prefills begin in spy.shapes
        starts.append(len(spy.shapes))
        return generate(prompts, params)

    engine.generate = marked
    calls = interleaved_calls(engine, tok, params)
    for prompts, completions in calls:
        assert_logprobs_match(model, prompts, completions)
    # Call 3 prefills only what follows each row's kept sequence: its widest new part is
    # the brand-new prompt "d" or a continuation, never a whole conversation.
    third_prompts, third_prefills = calls[2][0], spy.shapes[starts[2]:]
    assert sum(rows for rows, _ in third_prefills) == 4
    assert max(width for _, width in third_prefills) < min(len(p) for p in third_prompts[:2])
    assert engine.kept_rows == 4 + 1  # call 3's rows, plus a's, which call 3 skipped


def test_greedy_replies_are_the_same_with_each_optimisation_on_or_off(tiny):
    model, tok = tiny
    # Stopping on common characters makes rows finish at different steps (compaction runs).
    stops = tuple(tok.convert_tokens_to_ids(list("aeo ")))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=stops)
    replies = {}
    # Everything on, everything off, and each optimisation off on its own.
    for flags in [(True, True, True), (False, False, False), (False, True, True),
                  (True, False, True), (True, True, False)]:
        engine = HFEngine(model, tok.pad_token_id, **dict(zip(
            ["reuse_cache", "share_prompts", "compact"], flags, strict=True)))
        calls = interleaved_calls(engine, tok, params)
        replies[flags] = [[c.token_ids for c in out] for _, out in calls]
        for prompts, completions in calls:
            assert_logprobs_match(model, prompts, completions, temperature=1.0)
    assert len({repr(r) for r in replies.values()}) == 1
    reasons = {c.finish_reason for _, out in calls for c in out}
    assert reasons == {"stop", "length"}


def test_identical_prompts_are_prefilled_once(tiny):
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    group, other = encode(tok, "Guess a number."), encode(tok, "Hi")
    prompts = [group] * 4 + [other, group]
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE)
    completions = engine.generate(prompts, params)
    assert spy.shapes == [(2, len(group))]  # two distinct prompts, one prefill row each
    assert_logprobs_match(model, prompts, completions)
    assert len({tuple(c.token_ids) for c in completions[:4]}) > 1  # rows sample on their own
    # Each copy keeps its own cache: the next turn of every row continues from it.
    second = [continue_(p, c, tok) for p, c in zip(prompts, completions, strict=True)]
    assert_logprobs_match(model, second, engine.generate(second, params))
    assert spy.shapes[1][1] < len(group)


def test_compacted_rows_keep_their_cache_for_the_next_turn(tiny):
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0, compact=True)
    # Half the vocabulary stops a row: rows stop at different steps, most of them early.
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE,
                            stop_token_ids=tuple(range(0, len(tok), 2)))
    prompts = [encode(tok, text) for text in ["Say a digit.", "Hi", "abc", "Count: 1 2"]]
    first = engine.generate(prompts, params)
    assert_logprobs_match(model, prompts, first)
    assert min(spy.decode_rows) < len(prompts)  # stopped rows left the batch
    second = [continue_(p, c, tok) for p, c in zip(prompts, first, strict=True)]
    assert_logprobs_match(model, second, engine.generate(second, params))
    assert spy.shapes[1][1] < min(len(p) for p in second)  # every row reused its cache


def test_kept_rows_are_bounded_least_recently_written_first(tiny):
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0, max_kept_rows=2)
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE)
    old = [encode(tok, "one"), encode(tok, "two"), encode(tok, "three")]
    out = engine.generate(old, params)
    assert engine.kept_rows == 3  # a call's own rows are all kept, whatever the bound
    engine.generate([encode(tok, "four")], params)
    assert engine.kept_rows == 2  # "one" and "two", the oldest, were evicted
    again = [continue_(p, c, tok) for p, c in zip(old, out, strict=True)]
    assert_logprobs_match(model, again, engine.generate(again, params))
    assert spy.shapes[-1] == (3, max(len(p) for p in again[:2]))  # "one" re-read in full


def test_new_version_drops_the_cache(tiny):
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE)
    prompt = encode(tok, "Say a digit.")
    out = engine.generate([prompt], params)
    with torch.no_grad():  # an update: the kept keys and values no longer fit the weights
        model.model.norm.weight.mul_(1.5)
    engine.load(None, engine.version + 1)
    assert engine.kept_rows == 0
    second = [continue_(prompt, out[0], tok)]
    assert_logprobs_match(model, second, engine.generate(second, params))
    assert spy.shapes[-1] == (1, len(second[0]))


def test_keeping_the_cache_across_versions_reads_only_new_tokens_with_stale_keys(tiny):
    """PipelineRL's in-flight update: after a version bump the kept keys and values (of the
    old weights) are used, so only the new tokens are prefilled and the reply's log-probs
    differ from a fresh forward pass of the new weights (they are what the sampler used)."""
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0, keep_cache_across_versions=True)
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE)
    prompt = encode(tok, "Say a digit.")
    out = engine.generate([prompt], params)
    with torch.no_grad():  # changes every key of layer 0: the kept ones are now stale
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    engine.load(None, engine.version + 1)
    assert engine.kept_rows == 1
    second = [continue_(prompt, out[0], tok)]
    [reply] = engine.generate(second, params)
    kept = len(prompt) + len(out[0].token_ids) - 1  # the last sampled token was never fed
    assert spy.shapes[-1] == (1, len(second[0]) - kept)
    fresh = recomputed(model, second[0], reply)
    assert not torch.allclose(fresh, torch.tensor(reply.logprobs), atol=1e-3)


def test_grouped_query_attention_model(tiny):
    """SmolLM2 shares each key/value head among 3 query heads; decoding takes another path."""
    _, tok = tiny
    config = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE)
    prompts = [encode(tok, "Say a digit."), encode(tok, "Hi"), encode(tok, "Hi")]
    first = engine.generate(prompts, params)
    assert_logprobs_match(model, prompts, first)
    second = [continue_(p, c, tok) for p, c in zip(prompts, first, strict=True)]
    assert_logprobs_match(model, second, engine.generate(second, params))


def test_inverse_cdf_sampler_follows_the_tempered_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.log(probs).expand(4000, -1)
    params = SamplingParams(temperature=1.0)
    tokens, logprobs = _sample(logits, params, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5) / len(tokens)
    assert counts[1] == counts[4] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(counts, probs, atol=0.03)
    assert torch.allclose(logprobs, torch.log(probs)[tokens])
    hot = _sample(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(0))
    assert torch.allclose(hot[1], torch.log_softmax(torch.log(probs) / 2, -1)[hot[0]])


def test_a_long_fresh_prompt_is_prefilled_apart_from_short_continuations(tiny):
    """Rows whose new parts differ a lot in length are prefilled in separate buckets (no row
    padded to a fresh prompt's length), then decoded together; samples stay exact."""
    from turnrl.samplers.hf import MIN_SPLIT_TOKENS, _prefill_buckets

    assert _prefill_buckets([10, 300, 40, 280, 100]) == [[1, 3], [4], [0, 2]]
    assert _prefill_buckets([60, 2, 15]) == [[0, 1, 2]]  # short: one pass beats the padding
    model, tok = tiny
    spy = PrefillSpy(model)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE)
    short = [encode(tok, "Say a digit."), encode(tok, "Hi")]
    first = engine.generate(short, params)
    fresh = encode(tok, "A long rule book. " * 8)
    assert len(fresh) > 2 * MIN_SPLIT_TOKENS
    prompts = [continue_(short[0], first[0], tok), fresh, continue_(short[1], first[1], tok),
               fresh]
    before = len(spy.shapes)
    completions = engine.generate(prompts, params)
    assert_logprobs_match(model, prompts, completions)
    widths = sorted(width for _, width in spy.shapes[before:])
    assert len(widths) == 2 and widths[0] < 20 and widths[1] == len(fresh)
    again = [continue_(p, c, tok) for p, c in zip(prompts, completions, strict=True)]
    assert_logprobs_match(model, again, engine.generate(again, params))  # caches were kept


def test_released_sequences_lose_their_kept_cache_and_others_keep_theirs(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE)
    prompts = [encode(tok, "Say a digit."), encode(tok, "Hi")]
    completions = engine.generate(prompts, params)
    assert engine.kept_rows == 2
    ended = continue_(prompts[0], completions[0], tok, " done")  # the episode's final tokens
    engine.release([ended])
    assert engine.kept_rows == 1
    engine.release([encode(tok, "never generated")])  # unknown sequences are ignored
    assert engine.kept_rows == 1


def test_kept_rows_index_tells_apart_sequences_that_end_alike():
    """The index keys a kept sequence by its length and last tokens: sequences that share
    both but differ earlier must each be found, dropped and evicted as themselves."""
    kept = _KeptRows(version=0)
    a, b = (1, 2, 3, 9, 9, 9, 9), (5, 6, 7, 9, 9, 9, 9)  # same length, same last 4 tokens
    short = (1, 2)
    kept.replace([], [_Kept(t, torch.zeros(1)) for t in (short, a, b)], max_rows=10)
    assert [r and r.tokens for r in kept.match([a + (4,), b + (4,), (5, 6, 8, 9, 9, 9, 9, 4),
                                                (1, 2, 0), (1,), a])] == [a, b, None, short,
                                                                           None, short]
    kept.drop_prefixes_of(a + (4, 4))  # a and short are prefixes of it, b is not
    assert list(kept.rows) == [b] and kept.match([a + (4,)]) == [None]
    kept.replace([], [_Kept(a, torch.zeros(1))], max_rows=1)  # b evicted, a kept
    assert [r and r.tokens for r in kept.match([a + (4,), b + (4,)])] == [a, None]
    assert kept.find(b, len(b)) is None and kept.find(a, len(a)).tokens == a


def test_every_tensor_the_engine_makes_names_its_device(tiny):
    """On CUDA a tensor made on the CPU by default, mixed with the model's, crashed the first
    prefill (the causal mask's positions). With 'meta' as the default device (tensors with no
    data), any tensor the engine makes without naming its device lands there and the call
    fails: the class of bug shows on a CPU machine, and the samples must not change."""
    model, tok = tiny
    prompts = [tok("hello there")["input_ids"], tok("hi")["input_ids"]]
    params = SamplingParams(4, 1.0, 1.0)

    def two_turns(engine):
        first = engine.generate(prompts, params)
        longer = [p + c.token_ids + tok("ok")["input_ids"] for p, c in zip(prompts, first, strict=True)]
        return [c.token_ids for c in first + engine.generate(longer, params)]

    expected = two_turns(HFEngine(model, tok.pad_token_id, seed=3))
    with torch.device("meta"):
        assert two_turns(HFEngine(model, tok.pad_token_id, seed=3)) == expected


def test_generation_and_the_shared_prefix_update_use_the_current_cache_keyword(tiny, recwarn):
    """transformers 5 renamed ``past_key_values`` to ``cache`` and warns on the old name: a
    newcomer's first `make train` printed that warning. 4.x takes only the old name."""
    from turnrl.models import cache_kwargs

    model, tok = tiny
    HFEngine(model, tok.pad_token_id, seed=0).generate([tok("hello")["input_ids"]] * 2,
                                                        SamplingParams(3, 1.0, 1.0))
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]
    import inspect

    takes_cache = "cache" in inspect.signature(type(model).forward).parameters
    assert list(cache_kwargs(model, None)) == ["cache" if takes_cache else "past_key_values"]


def test_step_hook_names_each_callers_row_when_the_batch_reorders_them(tiny):
    """The buffer holds rows bucket by bucket and copies of shared prompts last, not in the
    caller's order: the step hook and the completions still name the caller's rows."""
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE)
    short = [encode(tok, "Say a digit."), encode(tok, "Hi")]
    first = engine.generate(short, params)
    fresh = encode(tok, "A long rule book. " * 8)
    prompts = [fresh, continue_(short[0], first[0], tok), fresh,
               continue_(short[1], first[1], tok), fresh]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def hook(rows):
        for i, token, _ in rows:
            streamed[i].append(token)

    completions = engine.generate(prompts, params, on_step=hook)
    assert_logprobs_match(model, prompts, completions)
    assert all(streamed[i] == c.token_ids for i, c in enumerate(completions))


def _windowed(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_sliding_window_is_applied_past_the_window():
    """The engine's explicit masks reach attention as given, so the engine applies the window
    itself (turnrl/samplers/masks.py): past a 4-token window its log-probs are the model's,
    with nothing to warn about (it used to drift, with a warning; tests/samplers/test_masks.py checks
    every family)."""
    import warnings

    windowed = {"mistral": _windowed("mistral", sliding_window=4),
                "qwen2": _windowed("qwen2", use_sliding_window=True, sliding_window=4,
                                   max_window_layers=0)}
    for model in windowed.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine = HFEngine(model, 0, seed=0)
        prompt = [5, 9, 14, 3, 40, 41, 7, 7, 21, 60]  # past the window
        completion = engine.generate([prompt], SamplingParams(4, 1.0, 1.0))[0]
        assert_logprobs_match(model, [prompt], [completion], 1.0)
