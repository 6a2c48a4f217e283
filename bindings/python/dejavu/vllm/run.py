"""A vLLM engine serving a list of token-id requests greedily, with the DejaVu connector (or
without it), step by step: what the demo and the tests start, kill and start again.

    python -m dejavu.vllm.run --model DIR --requests requests.json --out out.json \\
        [--sidecar S0.sock --successor HOST:PORT] [--progress progress.jsonl] [--crash-after N]

``requests.json`` lists batches of requests, ``[[{"id", "prompt": [token ids], "max_tokens"},
...], ...]`` (``"save": false`` in a request: the connector keeps no copy of it), each served to
the end before the next is submitted. ``--progress`` gets a JSON line when a batch is submitted
(``{"time", "submitted": [ids]}``) and after every engine step (``{"time", "tokens": {id: tokens
so far}}``), times in seconds of ``time.monotonic()``. ``--out`` gets, once all are done, each
request's ``tokens``, ``cached`` (tokens it did not compute: loaded from the sidecar, or found in
vLLM's own prefix cache when that is on) and ``seconds`` (from submission to its last token).

``--crash-after N`` makes the run crash at a known point: once every request of the last batch
has returned ``N`` tokens, and that step's progress line is written, it kills its whole process
group with SIGKILL (vLLM's engine core, which steps on by itself, dies wherever it is). Start it
in a process group of its own (``setsid``, or ``start_new_session=True``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Dict, List, Optional


def engine(
    model: str,
    sidecar: Optional[str],
    successor: Optional[str],
    keep_finished: int,
    prefix_caching: bool,
    max_model_len: Optional[int] = None,
):
    """A vLLM engine of ``model`` (token ids in and out, no tokenizer), with the connector when
    ``sidecar`` is given."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if sidecar is not None:
        transfer = KVTransferConfig(
            kv_connector="DejaVuConnector",
            kv_connector_module_path="dejavu.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"sidecar": sidecar, "successor": successor, "keep_finished": keep_finished},
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=transfer,
        max_model_len=max_model_len,
    )


def crash() -> None:
    """Kills this process group at once, as a crash of the machine's engine would."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def serve(llm, requests: List[dict], progress=None, crash_after: Optional[int] = None) -> Dict[str, dict]:
    """Serves ``requests`` to the end, greedily; writes each step's tokens to ``progress``.
    With ``crash_after``, crashes instead once every request has returned that many tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    core = llm.llm_engine
    submitted: Dict[str, float] = {}
    for request in requests:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=request["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": {"dejavu_save": request.get("save", True)}},
        )
        core.add_request(request["id"], TokensPrompt(prompt_token_ids=request["prompt"]), params)
        submitted[request["id"]] = time.monotonic()
    if progress is not None:
        progress.write(json.dumps({"time": time.monotonic(), "submitted": list(submitted)}) + "\n")
        progress.flush()
    done: Dict[str, dict] = {}
    returned = {request["id"]: 0 for request in requests}
    while core.has_unfinished_requests():
        step = {}
        for output in core.step():
            tokens = list(output.outputs[0].token_ids)
            step[output.request_id] = tokens
            returned[output.request_id] = len(tokens)
            if output.finished:
                done[output.request_id] = {
                    "tokens": tokens,
                    "cached": output.num_cached_tokens or 0,
                    "seconds": time.monotonic() - submitted[output.request_id],
                }
        if progress is not None and step:
            progress.write(json.dumps({"time": time.monotonic(), "tokens": step}) + "\n")
            progress.flush()
        if crash_after is not None and min(returned.values()) >= crash_after:
            crash()
    return done


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dejavu.vllm.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a transformers model directory")
    parser.add_argument("--requests", required=True, help="JSON list of batches of {id, prompt, max_tokens}")
    parser.add_argument("--out", required=True, help="where the finished requests go (JSON)")
    parser.add_argument("--sidecar", help="the local socket of this worker's dejavud sidecar (no connector without)")
    parser.add_argument("--successor", help="the ring successor's sidecar, host:port")
    parser.add_argument("--progress", help="a JSON line per engine step: the tokens of each request so far")
    parser.add_argument("--keep-finished", type=int, default=0, help="finished requests' KV kept for prefix reuse, the latest N")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache on")
    parser.add_argument("--max-model-len", type=int, help="the longest request (default: the model's)")
    parser.add_argument("--crash-after", type=int, help="crash once every request of the last batch returned N tokens")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="GiB of memory for vLLM's KV blocks (default 1)")
    args = parser.parse_args(argv)
    if args.crash_after is not None and os.getpgrp() != os.getpid():
        parser.error("--crash-after kills its process group: start it in one of its own (setsid)")
    # vLLM's CPU backend reads it at start; without it, it reserves most of the machine's memory.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_gib:g}")
    with open(args.requests) as f:
        batches = json.load(f)
    llm = engine(args.model, args.sidecar, args.successor, args.keep_finished, args.prefix_caching, args.max_model_len)
    progress = open(args.progress, "a") if args.progress else None
    done: Dict[str, dict] = {}
    try:
        for k, batch in enumerate(batches):
            crash_after = args.crash_after if k == len(batches) - 1 else None
            done.update(serve(llm, batch, progress, crash_after))
    finally:
        if progress is not None:
            progress.close()
    with open(args.out, "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    main()
