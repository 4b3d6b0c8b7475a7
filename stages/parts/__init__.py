"""The trained parts as generation loads them: a bridge, a prior, a decoder, an autoencoder's decoder.
No training code: stages/recover.py and stages/generate*.py read these; the stages that train each
part (bridge.py, prior.py, decoder.py, latent.py) write the files they read."""
