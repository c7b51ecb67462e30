"""One PPO worker process of the measured in-switch study (``python -m
omni_jax.rl.net_worker SPEC.json``): CartPole PPO (``rl.ppo``, unchanged) whose every
minibatch gradient is aggregated across processes by a
:class:`~omni_jax.collectives.netagg.NetAggregator` (in-switch relay sync / async, parameter
server, or TCP ring) on the netlab link.

The iteration (rollout, advantages, ``epochs x minibatches`` aggregated updates) is compiled
ahead of time, so the clock, started when every worker is connected (the relay's GO),
counts training only. After each iteration worker 0 checks the mean return of the training
episodes that ended in the last ``window`` iterations; the first time it reaches
``target_return`` it records the wall-clock time and raises the stop flag in its next
gradient, which every worker sees in an aggregate: all stop. Writes ``out`` (JSON): per
iteration (seconds since GO, episodes, return sum, exchanges so far), the client's exchange
log (compute, slept, network seconds), the time to target.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections

from omni_jax.collectives import netagg
from omni_jax.rl import envs, ppo


def main(spec_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  w = spec["worker"]
  client = netagg.Client(spec["method"], w, spec["ports"], 1, spec.get("staleness", 0),
                         spec.get("segment", 2048), spec.get("slow_factor", 1.0))
  env = envs.make_env(spec["env"])
  hp = ml_collections.ConfigDict(spec["hp"])
  algo = ppo.make(env, hp, netagg.NetAggregator(client), spec["max_iterations"])
  client.resize(algo.num_params + 1, spec.get("segment", 2048))
  state = algo.init(jax.random.PRNGKey(spec["seed"]), w)
  one = jax.jit(lambda s: algo.run(s, 1)).lower(state).compile()
  client.start()
  its, reached, window = [], None, spec["window"]
  for it in range(spec["max_iterations"]):
    state, m = one(state)
    m = jax.device_get(m)
    t = netagg.clock() - client.t0
    its.append({"seconds": t, "episodes": int(m["episodes"][0]),
                "return_sum": float(m["return_sum"][0]), "exchanges": client.step})
    recent = its[-window:]
    eps = sum(r["episodes"] for r in recent)
    mean = sum(r["return_sum"] for r in recent) / eps if eps else 0.0
    its[-1]["window_return"] = mean
    if w == 0 and reached is None and len(its) >= window and mean >= spec["target_return"]:
      reached = {"seconds": t, "iteration": it + 1, "exchanges": client.step}
      client.want_stop = True
      print(f"worker 0: target {spec['target_return']} reached at {t:.2f} s, iteration "
            f"{it + 1}", flush=True)
    if client.stopped:
      break
  client.close()
  out = {"worker": w, "method": spec["method"], "iterations": its, "time_to_target": reached,
         "exchange_log": client.log, "stopped": client.stopped,
         "num_params": algo.num_params, "slow_factor": client.slow,
         "aggregates_applied": client.version if spec["method"] == "async" else client.step}
  with open(spec["out"] + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
  main(sys.argv[1])
