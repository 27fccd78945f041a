"""Text-to-image model family of the BAGEL shape, model-level components.

An LLM prefill gives text hidden states; `denoiser.Denoiser` (a DiT with cross-attention to them) predicts
flow-matching velocities that `scheduler.FlowMatchEuler` integrates under classifier-free guidance; the
decoder half of a diffusers `AutoencoderKL` (`vae.VaeDecoder`) turns the final latents into RGB, and
`png` encodes it. `weights` loads the checkpoint directory that `checkpoint` writes (diffusers-like:
transformer/, vae/, scheduler/). Nothing here imports diffusers; the tests compare against it.
"""
