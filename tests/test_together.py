"""Runs of different users decoding together (the engine's running batch and shared prefill, kvviz.runtime.engine
and kvviz.runtime.together): one forward per step for every run's rows, runs joining and leaving mid-batch, each
run's result equal to the same run alone, token for token."""

from kvviz.comparison.session import PromptSession, compare, compare_job
from kvviz.methods import parse_spec
from kvviz.methods.window import Window
from kvviz.runtime import prefill
from kvviz.runtime.admission import RunSize
from kvviz.runtime.batch import DecodeGroup, Row
from kvviz.runtime.jobs import Cancelled, Decode, Job
from kvviz.runtime.replay import Sampling
from tests.test_batched import assert_same_rows

FIRST_SPECS = ["window:window=8", "h2o:heavy=4,recent=4", "snapkv:budget=16,window=4"]
SECOND_SPECS = ["streaming_llm:sinks=2,window=6", "tova:budget=10", "window:window=8"]


def together(loaded, runs: list[dict], listeners: list | None = None) -> list:
    """The runs' jobs submitted at once by as many users, so the engine admits them in one schedule: their prompts
    line up for its shared prefill and they decode in one running batch; each run's comparison (or its error)."""
    jobs = [compare_job(loaded, **run) for run in runs]
    handles = loaded.engine.submit_all(jobs, [f"user-{index}" for index in range(len(runs))])
    for handle, listener in zip(handles, listeners or [None] * len(runs), strict=True):
        handle.listener = listener and (lambda f, m, handle=handle, listener=listener: listener(handle, m))
    outcomes = []
    for handle in handles:
        try:
            outcomes.append(handle.result(300))
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcomes.append(error)
    return outcomes


def test_two_prompts_of_different_lengths_in_one_batch_give_each_its_results_alone(tiny_model, story_ids):
    decoder = tiny_model.engine
    shared_before, forwards_before, seconds_before = decoder.shared_forwards, decoder.forwards, decoder.seconds
    runs = [dict(prompt_ids=story_ids[:60], specs=FIRST_SPECS, max_new_tokens=10),
            dict(prompt_ids=story_ids[5:45], specs=SECOND_SPECS, max_new_tokens=4)]  # joins late, leaves early
    first, second = together(tiny_model, runs)
    assert decoder.shared_forwards > shared_before, "the two runs shared forwards"
    assert decoder.forwards - forwards_before >= 10 and decoder.seconds > seconds_before, "steps counted and timed"
    for outcome, run in zip((first, second), runs, strict=True):
        alone = compare(tiny_model, **run, batched=False)
        assert_same_rows(outcome, alone)
        assert len(outcome.by_method("full").token_ids) == run["max_new_tokens"]


def test_a_run_resumes_once_its_group_finished_not_after_its_first_step(tiny_model, story_ids):
    """A run's steps wait while its group decodes in the running batch: they see every row's tokens when they
    resume (a run that came back after its first step would report the text of one token)."""
    session = PromptSession(tiny_model, story_ids[:30])
    first_logits = session.prefill().last_logits
    rows = [Row(parse_spec(spec), session.fork(parse_spec(spec)), first_logits) for spec in ("full", "window:window=8")]
    group = DecodeGroup(rows, 4, set(), Sampling())

    def decodes(progress):
        yield Decode([group])
        return [len(row.trace.token_ids) for row in rows]

    assert tiny_model.engine.run(Job(decodes, RunSize(60, "cpu"))) == [4, 4] and group.finished


def test_a_run_cancelled_mid_batch_leaves_and_the_other_finishes_as_alone(tiny_model, story_ids):
    def cancel_at_token_3(handle, message: str) -> None:
        if message.startswith("token 3/"):
            handle.cancel()  # its user presses Cancel: the run leaves before the next forward

    runs = [dict(prompt_ids=story_ids[:50], specs=FIRST_SPECS, max_new_tokens=8),
            dict(prompt_ids=story_ids[10:70], specs=SECOND_SPECS, max_new_tokens=8)]
    kept, cancelled = together(tiny_model, runs, [None, cancel_at_token_3])
    assert isinstance(cancelled, Cancelled)
    assert_same_rows(kept, compare(tiny_model, **runs[0], batched=False))


def test_one_users_failing_method_does_not_touch_another_users_run(tiny_model, story_ids, monkeypatch):
    broken_prompt = 44
    original = Window.select

    def breaks_on_one_prompt(self, view):
        if view.prompt_length == broken_prompt and view.step == 2:
            raise RuntimeError("simulated kernel failure")
        return original(self, view)

    runs = [dict(prompt_ids=story_ids[:60], specs=FIRST_SPECS, max_new_tokens=8),
            dict(prompt_ids=story_ids[:broken_prompt], specs=SECOND_SPECS, max_new_tokens=8)]
    alone = [compare(tiny_model, **run, batched=False) for run in runs]
    monkeypatch.setattr(Window, "select", breaks_on_one_prompt)
    healthy, hurt = together(tiny_model, runs)
    assert_same_rows(healthy, alone[0])
    assert hurt.by_method("window:window=8").error == "RuntimeError: simulated kernel failure"
    for ours, theirs in zip(hurt.results, alone[1].results, strict=True):
        if ours.method != "window:window=8":
            assert ours.error is None and ours.token_ids == theirs.token_ids, ours.method


def test_prompts_waiting_together_share_one_prefill_and_each_run_equals_alone(tiny_model, story_ids):
    engine = tiny_model.engine
    forwards, shared = engine.prefills, engine.shared_prefills
    specs = ["window:window=8", "kivi:bits=2", "streaming_llm:sinks=2,window=6"]  # nothing records the prompt
    runs = [dict(prompt_ids=story_ids[:31], specs=specs, max_new_tokens=6),
            dict(prompt_ids=story_ids[40:83], specs=specs[:1], max_new_tokens=3),
            dict(prompt_ids=story_ids[7:27], specs=specs[1:], max_new_tokens=5),
            dict(prompt_ids=story_ids[:50], specs=["snapkv:budget=16,window=4"], max_new_tokens=4)]
    outcomes = together(tiny_model, runs)
    assert (engine.prefills - forwards, engine.shared_prefills - shared) == (1, 1), \
        "the three prompts nobody records shared one forward; SnapKV's capture prefilled on its own"
    for outcome, run in zip(outcomes, runs, strict=True):
        assert_same_rows(outcome, compare(tiny_model, **run, batched=False))


def test_a_shared_prefill_that_fails_fails_every_run_in_it(tiny_model, story_ids, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("simulated: out of memory")

    monkeypatch.setattr(prefill, "prefill_rows", out_of_memory)
    runs = [dict(prompt_ids=story_ids[i:i + 20], specs=["window:window=8"], max_new_tokens=3) for i in (0, 30)]
    outcomes = together(tiny_model, runs)
    assert [str(outcome) for outcome in outcomes] == ["simulated: out of memory"] * 2
    monkeypatch.undo()
    assert compare(tiny_model, **runs[0]).by_method("full").error is None, "the model serves the next run"
