"""Diffusion machinery shared by every trained part: the denoiser network and the flow path/sampler."""
