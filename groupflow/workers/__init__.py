"""Worker classes a worker group runs (the actor-rollout worker, critic, reward model, frozen
inference copies) and their shared update bookkeeping. Nothing is re-exported here: a worker
group imports the class it places."""
