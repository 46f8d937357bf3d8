"""bench/quality.py's scores: one system's output at each position (Scores), and llama-server's,
taken through its /completion endpoint with the true next token forced by a logit bias."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Scores:
    """One system's output at each position: the true next token's logprob, its top-K tokens
    (best first), and the exact KL where the full distribution was seen."""

    name: str
    true_logprob: list[float]
    top: list[list[tuple[int, float]]]
    exact_kl: list[float] | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# --- llama-server -----------------------------------------------------------------------------


def score_llama_server(
    model: str, tokens: list[int], windows: list[tuple[int, int]], top_k: int, threads: int
) -> Scores:
    import httpx
    import peer_builds
    import peers

    build = peer_builds.BUILDS["llama-server"]
    record = peer_builds.build(build)  # a no-op when its marker says this spec is built
    files = peers.load_model_files(model)
    ctx = peers.LaunchContext(
        model=files, threads=threads, port=peers.free_port(), slots=1, run_dir=peer_builds.PEERS_DIR / "run"
    )
    server = peers.RunningServer(peers.SERVERS["llama-server"], ctx)
    scores = Scores("llama-server", [], [])
    scores.notes.append(
        f"{' '.join(build.requirements)} built {record.finished_at}: {' '.join(server.command)}"
    )
    evaluated = checked = 0
    started = time.perf_counter()
    try:
        with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
            for start, stop in windows:
                for i in range(start, stop):
                    target = tokens[i + 1]
                    body = {
                        "prompt": tokens[start : i + 1],
                        "n_predict": 1,
                        "n_probs": top_k,
                        "cache_prompt": True,
                        "temperature": 0.0,
                        "post_sampling_probs": False,
                        "logit_bias": [[target, 100.0]],
                    }
                    response = client.post("/completion", json=body)
                    response.raise_for_status()
                    reply = response.json()
                    evaluated += int(reply["timings"]["prompt_n"])
                    probs = reply["completion_probabilities"][0]
                    if probs["id"] != target:
                        raise RuntimeError(f"llama-server sampled {probs['id']}, not the biased {target}")
                    top = [(int(e["id"]), float(e["logprob"])) for e in probs["top_logprobs"]]
                    in_top = dict(top).get(target)
                    if in_top is not None:
                        if in_top != probs["logprob"]:
                            raise RuntimeError(
                                f"llama-server: {target}'s logprob {probs['logprob']} vs {in_top}"
                            )
                        checked += 1
                    scores.true_logprob.append(float(probs["logprob"]))
                    scores.top.append(top)
    finally:
        server.stop()
    scores.seconds = time.perf_counter() - started
    scores.notes.append(
        f"{evaluated} prompt tokens evaluated for {len(scores.top)} requests (prompt cache); the true "
        f"token's logprob equals its top-{top_k} entry at all {checked} positions where it is in it"
    )
    return scores
