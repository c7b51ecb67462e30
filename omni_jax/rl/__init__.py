"""Distributed RL (iSwitch): envs, one file per algorithm, runner, predictions.

``envs`` (protocol, gymnax wrappers, registry), ``ppo`` / ``a2c`` / ``dqn`` / ``ddpg``
(PureJaxRL-style pure training functions; PPO takes discrete or continuous actions through
``policies`` and optional running normalisation from ``normalize``), ``runner`` (config ->
workers on a mesh axis, jitted chunks), ``predict`` (timing-model iteration times),
``bench`` (our PPO vs a plain PPO, time-to-reward: what ``experiments.bench_rl`` runs).
Gradient aggregation is ``omni_jax.collectives.aggregate.Aggregator`` (methods in
``omni_jax.collectives.methods``).
"""
