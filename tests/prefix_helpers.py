"""Test helpers for prefix caching: run requests step by step and record what a cold run must reproduce (each
request's output and the MTP drafts it holds after each step), and multi-turn conversations."""

from qwen_mtp import SamplingParams
from qwen_mtp.engine.request import Status


def drain(engine):
    """Step until nothing runs (the cache fills of finished requests included)."""
    while engine.has_unfinished():
        engine.step()


class Recorder:
    """Run requests on an engine step by step, keeping each one's output and the drafts it holds after every
    step past its prefill (the first of them is the first draft after the prompt)."""

    def __init__(self, engine):
        self.engine = engine
        self.live: dict[int, object] = {}
        self.drafts: dict[int, list[list[int]]] = {}
        self.outputs: dict[int, list[int]] = {}

    def submit(self, prompt, max_new):
        rid = self.engine.submit(prompt, SamplingParams(max_new, ignore_eos=True))
        self.live[rid], self.drafts[rid] = self.engine.requests[rid], []
        return rid

    def step(self):
        self.engine.step()
        for rid, request in list(self.live.items()):
            if request.status is Status.RUNNING and not request.in_prefill:
                self.drafts[rid].append(list(request.drafts))
            if request.done:
                self.outputs[rid] = self.engine.result(rid).token_ids
                del self.live[rid]

    def cancel(self, rid):
        self.engine.cancel(rid)
        self.outputs[rid] = self.engine.result(rid).token_ids
        del self.live[rid]

    def finish(self):
        while self.live:
            self.step()
        drain(self.engine)


def converse(engine, turns: list[list[int]], max_new: int):
    """A conversation: each turn's prompt is the whole history plus its message. Returns per turn the output,
    the drafts, and the prompt positions restored from the cache."""
    history, record = [], []
    for message in turns:
        prompt = history + message
        recorder = Recorder(engine)
        rid = recorder.submit(prompt, max_new)
        request = engine.requests[rid]
        recorder.finish()  # the turn, then the fill that caches its output chunks
        record.append((recorder.outputs[rid], recorder.drafts[rid], request.cached_tokens))
        history = prompt + recorder.outputs[rid]
    return record
