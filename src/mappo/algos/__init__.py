"""The MAPPO algorithm: advantages and returns (pure functions) and the PPO update."""
