"""Lightning callbacks of the framework; each knows nothing of Hydra or of the others."""
