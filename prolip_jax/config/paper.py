"""The papers' loss hyperparameters, each number written once.

The pure loss functions of ``prolip_jax.losses`` take them as keyword
defaults (``losses.probabilistic.ALPHA1`` is ``ALPHA1`` here) and
``config_keys.KEYS`` declares them as the ``loss.*`` defaults of a run.
Plain numbers, no JAX: the key table imports this module.
"""

# ProLIP (Chun et al., ICLR 2025), eq. 6 with the B.1 recipe (and the
# release's training script).
ALPHA1 = 1e-7  # weight of L_inclusion(Z_v ⊂ Z_t)
ALPHA2 = 1e-3  # weight of L_inclusion(Z ⊂ Z_masked), images and texts
BETA = 1e-4  # weight of the VIB regulariser
INCLUSION_C = 1000.0  # sharpness c of the inclusion loss
INCLUSION_EPS = -20.0  # stability exponent of the inclusion loss (training)

# OTTER (Wu et al.), section 4 / Algorithm 1.
OTTER_ALPHA = 0.5  # weight of the hard InfoNCE labels
OTTER_LAMBDA = 0.15  # Sinkhorn temperature
OTTER_ITERS = 5  # Sinkhorn iterations
OTTER_GAMMA_V = 1.0  # weight of the teacher's image-image similarity
OTTER_GAMMA_T = 1.0  # weight of the teacher's text-text similarity
OTTER_ETA = 100.0  # diagonal penalty of the targets
OTTER_EMA_DECAY = 0.999  # of the teacher (OTTER's optim.ema_decay)

# PC-CLIP (Sam et al.), appendix C.1: temperature of the contrastive loss.
PCCLIP_TAU = 1.0

# PCME++'s release: initial a ("negative_scale") and b ("shift").
PCME_SCALE_INIT = 5.0
PCME_BIAS_INIT = 5.0
