"""Model loading on top of mlx-lm."""
