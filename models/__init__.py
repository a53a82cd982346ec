"""Models written once with logical axis names (Flax NNX); they never name a mesh axis."""
