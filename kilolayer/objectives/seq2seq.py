"""``seq2seq``: sequence-to-sequence with teacher forcing; at evaluation, token accuracy, and greedy decoding
scored by exact match, BLEU and chrF, each with a bootstrap interval (:mod:`kilolayer.objectives.text_scores`);
the baselines those sit beside: :mod:`kilolayer.objectives.baselines`. It generates greedily or by beam search."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import nn

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.data.synthetic import Seq2SeqSource
from kilolayer.errors import ConfigError, InputError
from kilolayer.objectives.base import Objective, batch_size, head_weights, register_objective
from kilolayer.objectives.baselines import baseline_hypotheses, baseline_scores
from kilolayer.objectives.decoding import Decoding
from kilolayer.objectives.directions import direction_table
from kilolayer.objectives.text_scores import SCORES, text_scores


class Seq2SeqOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    decode_samples: int | None = Field(
        None,
        ge=0,
        description="evaluation pairs decoded greedily: every one (null, the default), the first N, 0 = none",
    )
    max_new_tokens: int = Field(0, ge=0, description="0 = source length + 8, capped by model.max_len")


@register_objective
class Seq2Seq(Objective):
    name = "seq2seq"
    archs = ("encoder_decoder",)
    metrics = ("loss", "token_accuracy", *(f"{s}{end}" for s in SCORES for end in ("", "_low", "_high")))

    @classmethod
    def logs(cls, options: dict) -> tuple[str, ...]:
        # decode_samples: 0 decodes no pair, so no text score is logged
        if options.get("decode_samples") == 0:
            return ("loss", "token_accuracy")
        return cls.metrics

    def __init__(self, config, backbone, source: Source | None):
        super().__init__(config, backbone, source)
        if source is not None and not isinstance(source, Seq2SeqSource):
            raise ConfigError(
                f"data.name={config.data.name!r}: objective 'seq2seq' needs a source of (source, target) pairs"
            )
        m = config.model
        self.opts = parse_options(Seq2SeqOptions, config.objective.options, "objective.options")
        self.head = nn.Linear(m.width, m.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=m.width**-0.5)
        # BOS/EOS ids and the detokenizer (for the decoding's scores) are the data's; without data, those of
        # plain id sequences. The source also names the baselines the scores sit beside.
        self.bos, self.eos = 1, 2
        self.detokenize = lambda ids: " ".join(str(int(i)) for i in ids)
        self.source = source
        if source is not None:
            self.bos, self.eos, self.detokenize = source.bos, source.eos, source.detokenize

    def label_smoothing(self) -> tuple[float, int]:
        return self.opts.label_smoothing, self.head.out_features

    def forward(self, backbone, batch):
        h = backbone(batch["src"], batch["tgt_in"], batch["src_padding_mask"], batch["tgt_padding_mask"])
        logits = self.head(h).float()
        y = batch["tgt_out"].masked_fill(batch["tgt_padding_mask"], -100)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            y.reshape(-1),
            ignore_index=-100,
            label_smoothing=self.opts.label_smoothing,
        )
        return loss, {}

    @torch.no_grad()
    def greedy(self, backbone, src, src_padding_mask, bos: int, eos: int, max_new: int) -> torch.Tensor:
        """Greedy decoding; returns (B, <= max_new) ids, EOS-terminated rows padded with EOS."""
        memory = backbone.encode(src, src_padding_mask)
        out = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_new):
            h = backbone.decode(out, memory, None, src_padding_mask)
            nxt = self.head(h[:, -1]).argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= nxt == eos
            if bool(done.all()):
                break
        return out[:, 1:]

    def max_new(self, source_length: int, requested: int | None = None) -> int:
        """The most tokens a decoding writes: ``requested``, else ``objective.options.max_new_tokens``, else the
        source's length + 8; at most ``model.max_len - 1``, the positions the decoder has after BOS."""
        return min(requested or self.opts.max_new_tokens or source_length + 8, self.config.model.max_len - 1)

    @torch.no_grad()
    def beam_search(
        self, backbone, src, src_padding_mask, bos: int, eos: int, max_new: int, beams: int, length_penalty: float = 1.0
    ) -> list[tuple[list[int], float]]:
        """The ``beams`` best hypotheses for one source (``src`` (1, S)), best first, each (ids without BOS or EOS,
        log-probability with EOS). Each step extends every live hypothesis by each token; of the ``beams`` best
        extensions, those ending in EOS are finished, and the ``beams`` best others live on. The search stops once
        ``beams`` are finished (or after ``max_new`` tokens, when live ones fill the list). Ranked by
        log-probability / length ** ``length_penalty``, the length counting EOS. With one beam this is greedy
        decoding."""
        memory = backbone.encode(src, src_padding_mask)
        seqs = torch.full((1, 1), bos, dtype=torch.long, device=src.device)
        scores = torch.zeros(1, device=src.device)
        done: list[tuple[list[int], float]] = []
        for _ in range(max_new):
            k = seqs.shape[0]
            h = backbone.decode(seqs, memory.repeat(k, 1, 1), None, src_padding_mask.repeat(k, 1))
            logp = self.head(h[:, -1]).float().log_softmax(-1)
            top = (scores[:, None] + logp).flatten().topk(min(2 * beams, logp.numel()))
            rows, tokens, kept = [], [], []
            for place, (value, index) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                row, token = divmod(index, logp.shape[-1])
                if token == eos:
                    if place < beams:  # an ending that is not among the best extensions is not taken
                        done.append((seqs[row, 1:].tolist(), value))
                elif len(rows) < beams:
                    rows, tokens, kept = rows + [row], tokens + [token], kept + [value]
            if len(done) >= beams:
                break
            seqs = torch.cat([seqs[rows], torch.as_tensor(tokens, device=src.device)[:, None]], dim=1)
            scores = torch.as_tensor(kept, device=src.device)
        else:  # out of length: unfinished hypotheses fill the list
            done += [(s[1:], v) for s, v in zip(seqs.tolist(), scores.tolist())]
        rank = lambda hyp: hyp[1] / (len(hyp[0]) + 1) ** length_penalty
        return sorted(done, key=rank, reverse=True)[:beams]

    @torch.no_grad()
    def generate(
        self, backbone, prompt: list[int], decoding: Decoding, bos: int | None = None, eos: int | None = None
    ) -> list[int]:
        """The ids of the output for the source ids ``prompt``, without BOS or EOS: greedy (:meth:`greedy`, the
        evaluation's decoding) or, with ``decoding.beams`` > 1, :meth:`beam_search`; at most :meth:`max_new`
        tokens. ``bos``/``eos`` default to the data's."""
        m = self.config.model
        if not prompt or len(prompt) > m.max_len:
            raise InputError(f"prompt: {len(prompt)} tokens; a source is 1 to model.max_len={m.max_len} tokens")
        if decoding.sampling:
            raise ConfigError(
                "temperature/top_k/top_p: seq2seq decodes greedily or by beam search (beams), not by sampling"
            )
        bos, eos = self.bos if bos is None else bos, self.eos if eos is None else eos
        src = torch.as_tensor([prompt], dtype=torch.long, device=self.head.weight.device)
        mask = torch.zeros_like(src, dtype=torch.bool)
        max_new = self.max_new(len(prompt), decoding.max_new_tokens)
        if decoding.beams > 1:
            best = self.beam_search(backbone, src, mask, bos, eos, max_new, decoding.beams, decoding.length_penalty)
            return best[0][0]
        out = self.greedy(backbone, src, mask, bos, eos, max_new)[0].tolist()
        return out[: out.index(eos)] if eos in out else out

    @torch.no_grad()
    def evaluate(self, backbone, batches):
        """``loss`` and ``token_accuracy`` (teacher-forced argmax over the target tokens the loss counts, the end
        token included) over every evaluation pair; then the first ``decode_samples`` pairs (all by default)
        decoded greedily, scored by :func:`~kilolayer.objectives.text_scores.text_scores`: ``exact_match``,
        ``bleu``, ``chrf`` and each one's 95% interval (``_low``, ``_high``)."""
        batches = list(batches)
        out = super().evaluate(backbone, batches)
        right = total = 0
        for batch in batches:
            keep = ~batch["tgt_padding_mask"]
            guess = self.head(self.represent(backbone, batch)).argmax(-1)
            right += int((guess == batch["tgt_out"])[keep].sum())
            total += int(keep.sum())
        out["token_accuracy"] = right / max(total, 1)
        hyps, refs = [], []
        for batch in self.decoded(batches):
            src, mask = batch["src"], batch["src_padding_mask"]
            pred = self.greedy(backbone, src, mask, self.bos, self.eos, self.max_new(src.shape[1]))
            hyps += [self.detokenize(row) for row in pred.tolist()]
            refs += [self.detokenize(t) for _, t in pairs_of(batch)]
        self.last_decoded = hyps  # what baselines() sets beside its own hypotheses of the same pairs
        return {**out, **text_scores(hyps, refs)}

    def decoded(self, batches: list[dict]):
        """The evaluation batches cut to the first ``decode_samples`` pairs: the pairs decoding scores."""
        cap, seen = self.opts.decode_samples, 0
        for batch in batches:
            rows = len(batch["src"]) if cap is None else min(cap - seen, len(batch["src"]))
            if rows <= 0:
                return
            yield {k: v[:rows] for k, v in batch.items()}
            seen += rows

    def baselines(self, batches, paired: bool = False):
        """:func:`~kilolayer.objectives.baselines.baseline_scores` of the pairs decoding scores, and their number;
        where the batches carry each pair's ``direction`` (a many-to-many source), also ``directions``: the model's
        (when ``paired``) and the baselines' scores per direction (:func:`~kilolayer.objectives.directions.
        direction_table`)."""
        if self.source is None:
            return {}
        decoded = list(self.decoded(list(batches)))
        pairs = [p for batch in decoded for p in pairs_of(batch)]
        if not pairs:
            return {}
        model = getattr(self, "last_decoded", None) if paired else None
        model = model if model is not None and len(model) == len(pairs) else None
        of_pair = [d for b in decoded for d in b["direction"].tolist()] if "direction" in decoded[0] else None
        hypotheses = baseline_hypotheses(self.source, pairs, of_pair)
        out = {"pairs": len(pairs), "baselines": baseline_scores(self.source, pairs, model, hypotheses)}
        if of_pair is not None:
            refs = [self.detokenize(t) for _, t in pairs]
            systems = {"model": model} if model is not None else {}
            systems.update({name: [self.detokenize(h) for h in ids] for name, ids in hypotheses.items()})
            out["directions"] = direction_table(self.source.directions, of_pair, refs, systems)
        return out

    def represent(self, backbone, batch):
        return backbone(batch["src"], batch["tgt_in"], batch["src_padding_mask"], batch["tgt_padding_mask"])

    def analysis_inputs(self, batch):
        # the encoder's layers: src through encode()
        return {"src": batch["src"], "src_padding_mask": batch["src_padding_mask"]}, batch["src_padding_mask"]

    def tokens(self, batch):
        return int((~batch["src_padding_mask"]).sum() + (~batch["tgt_padding_mask"]).sum())

    def train_flops(self, batch):
        # the source through the encoder, the target through the decoder, the LM head on target tokens only
        B = batch_size(batch)
        src, tgt = int((~batch["src_padding_mask"]).sum()), int((~batch["tgt_padding_mask"]).sum())
        return self.backbone_flops(B, src / B, tgt / B) + 6.0 * head_weights(self) * tgt

    def loss_weight(self, batch):
        # the loss is a mean over the target's tokens; the source's do not count
        return int((~batch["tgt_padding_mask"]).sum())

    def eval_targets(self, batch, index):
        return batch["tgt_out"][~batch["tgt_padding_mask"]]


def pairs_of(batch: dict) -> list[tuple[list[int], list[int]]]:
    """The (source ids, target ids) of a batch's rows, as they were before batching (no padding, no end token)."""
    out = []
    for src, src_pad, tgt, tgt_pad in zip(
        batch["src"], batch["src_padding_mask"], batch["tgt_out"], batch["tgt_padding_mask"]
    ):
        out.append((src[~src_pad].tolist(), tgt[~tgt_pad].tolist()[:-1]))
    return out
