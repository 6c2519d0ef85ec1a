"""DeepNorm (DeepNet, arXiv 2203.00555): its constants (Figure 2(b); docs/deepnet.md) and its residual scheme.

Every attention and FFN sublayer computes ``x <- LN(alpha * x + G(x))``; the
value, output and FFN weights start Xavier-normal with gain ``beta``
(docs/deepnet.md).
"""

from __future__ import annotations

from kilolayer.errors import ConfigError
from kilolayer.nn.residual import SCHEMES, Depth
from kilolayer.nn.schemes import SCALED, PostLN

ARCHS = ("encoder", "decoder", "encoder_decoder")


def deepnorm_constants(arch: str, encoder_layers: int = 0, decoder_layers: int = 0) -> dict:
    """``{"encoder": (alpha, beta), "decoder": (alpha, beta)}`` with only the sides that exist.

    ``arch`` is ``"encoder"`` (N = encoder_layers), ``"decoder"`` (M =
    decoder_layers) or ``"encoder_decoder"`` (both).
    """
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r}: expected one of {', '.join(ARCHS)}")
    n, m = int(encoder_layers), int(decoder_layers)
    if arch in ("encoder", "encoder_decoder") and n < 1:
        raise ConfigError(f"encoder_layers={encoder_layers}: an {arch} needs at least 1 encoder layer")
    if arch in ("decoder", "encoder_decoder") and m < 1:
        raise ConfigError(f"decoder_layers={decoder_layers}: a {arch} needs at least 1 decoder layer")
    if arch == "encoder":
        return {"encoder": ((2 * n) ** 0.25, (8 * n) ** -0.25)}
    if arch == "decoder":
        return {"decoder": ((2 * m) ** 0.25, (8 * m) ** -0.25)}
    return {
        "encoder": (0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)),
        "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25),
    }


@SCHEMES.register()
class DeepNorm(PostLN):
    """DeepNorm: x <- LN(alpha x + G(x)); Xavier gain beta on V, O, W1, W2 (self- and cross-attention)."""

    name = "deepnorm"

    def __init__(self, depth: Depth, **options):
        super().__init__(depth, **options)
        self.constants = deepnorm_constants(depth.arch, depth.N, depth.M)

    def alpha(self, site):
        return self.constants[site.side][0]

    def init_gain(self, site, weight):
        return self.constants[site.side][1] if weight in SCALED else 1.0

    def describe(self):
        return {side: {"alpha": alpha, "beta": beta} for side, (alpha, beta) in self.constants.items()}
