"""The nouns of autoshard: the op graph, the cluster topology and the plan."""
