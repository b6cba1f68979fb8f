"""SeqPE: digit sequences, the PE network's input layout, the q/k modulation written out by hand, the evaluation
cache, the grid limit of max_digits, the contrastive and transfer losses against explicit computations, the shift
augmentation, and the Classifier adding the losses to its training loss."""

import math

import pytest
import torch
import torch.nn.functional as F

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.seqpe import SeqPE, _hard_negatives, contrastive_batch, max_digits_for, pos2seq

GRID = (3, 5)  # non-square: an x/y swap shows
SMALL = {
    "embed_dim": 32,
    "encoder_heads": 2,
    "contrastive_pivots": 4,
    "contrastive_candidates": 8,
    "transfer_windows": 2,
    "transfer_offsets": 6,
}


def _scheme(**kwargs) -> SeqPE:
    torch.manual_seed(0)
    options = {**SMALL, "grid_size": GRID, **kwargs}
    return visionpe.create_pos_embed("seqpe", dim=32, num_heads=2, depth=2, **options)


def test_pos2seq_writes_each_axis_left_padded_row_first():
    assert pos2seq(torch.tensor([2, 3]), 2).tolist() == [0, 2, 0, 3]
    assert pos2seq(torch.tensor([[7, 120], [0, 5]]), 3).tolist() == [[0, 0, 7, 1, 2, 0], [0, 0, 0, 0, 0, 5]]
    assert [max_digits_for(n) for n in (10000, 400, 100, 10001, 40000)] == [2, 2, 1, 2, 3]
    assert _scheme().max_digits == 2 and _scheme(pe_max_position=100).max_digits == 1


def test_encoder_input_is_digit_slot_axis_embeddings_with_the_summary_last_and_is_causal():
    encoder = _scheme(dropout=0.0).eval().encoder
    digits = pos2seq(torch.tensor([[2, 3], [41, 7]]), 2)
    seen = {}
    encoder.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("input", args[0]))
    encoder.blocks[-1].register_forward_hook(lambda m, args, out: seen.setdefault("output", out))
    with torch.no_grad():
        encoder(digits)
    axis = torch.stack([encoder.axis_embed[0]] * 2 + [encoder.axis_embed[1]] * 2)  # slots 0, 1: y; 2, 3: x
    expected = encoder.digit_embed.weight[digits] + encoder.slot_embed + axis
    torch.testing.assert_close(seen["input"][:, :4], expected)
    torch.testing.assert_close(seen["input"][:, 4], encoder.summary_token.expand(2, -1))
    # causal: changing the third digit (x's tens) leaves the outputs of the first two positions as they were
    before = seen.pop("output")
    changed = digits.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 10
    seen.pop("input")
    with torch.no_grad():
        encoder(changed)
    torch.testing.assert_close(seen["output"][:, :2], before[:, :2])
    assert not torch.allclose(seen["output"][:, 2:], before[:, 2:])


def test_modulation_is_q_times_pe_q_and_k_times_pe_k():
    scheme = _scheme().eval()
    coords = grid_coords(GRID)
    state = scheme.prepare(coords, 1, grid_size=GRID)
    with torch.no_grad():
        vectors = scheme.encoder(pos2seq(coords.long(), 2))
        vectors = torch.cat((scheme.cls_token_pos_embed[None], vectors))  # the cls token: its learned vector
    q, k = torch.randn(2, 3, 2, 1 + 15, 16).unbind(0)
    for layer in range(2):
        pe = vectors @ scheme.qk_weight[layer].T + scheme.qk_bias[layer]  # the block's Linear(C, 2C)
        pe = pe.view(16, 2, 2, 16)  # (tokens, q|k, heads, head_dim)
        pe_q, pe_k = pe[:, 0].transpose(0, 1), pe[:, 1].transpose(0, 1)  # (heads, tokens, head_dim)
        out_q, out_k = scheme.apply(torch.stack([q, k]), state, layer)
        torch.testing.assert_close(out_q, q * pe_q)
        torch.testing.assert_close(out_k, k * pe_k)
        torch.testing.assert_close(scheme.rotations(coords, layer), torch.stack([pe_q, pe_k])[:, :, 1:])
        # a single tensor is modulated as queries (RotaryPositionEncoding.rotate)
        torch.testing.assert_close(scheme.rotate(q[:, :, 1:], coords, layer), q[:, :, 1:] * pe_q[:, 1:])
    # patch dropout: the kept rows of the full-grid modulation
    keep = torch.tensor([[0, 3, 7], [0, 15, 1], [0, 2, 2]])
    kept = torch.stack([q, k]).gather(3, keep[None, :, None, :, None].expand(2, 3, 2, 3, 16))
    full = scheme.apply(torch.stack([q, k]), state, 1)
    expected = full.gather(3, keep[None, :, None, :, None].expand(2, 3, 2, 3, 16))
    torch.testing.assert_close(state.layer(1).rotate_kept(kept, keep), expected)
    # not a rotation: norms change
    assert not torch.allclose(out_q.norm(dim=-1), q.norm(dim=-1), rtol=1e-2)


def test_eval_vectors_are_deterministic_and_cached_per_grid():
    scheme = _scheme().eval()
    calls = []
    scheme.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    coords = grid_coords(GRID)
    with torch.no_grad():
        first = scheme.prepare(coords, 1, grid_size=GRID).vectors
        second = scheme.prepare(coords, 1, grid_size=GRID).vectors
        assert torch.equal(first, second) and calls == [15]  # one PE network call for the grid
        other = scheme.prepare(grid_coords((5, 3)), 1, grid_size=(5, 3)).vectors
        assert calls == [15, 15] and not torch.equal(other, first)  # the transposed grid is another entry
        scheme.prepare(coords, 0, grid_size=GRID)
        assert calls == [15, 15]  # still cached (the prefix is added after the cache)
        scheme.encoder.proj.bias.add_(0.5)  # an update of the weights (optimizer step, load_state_dict)
        updated = scheme.prepare(coords, 1, grid_size=GRID).vectors
        assert calls == [15, 15, 15]
        torch.testing.assert_close(updated[:, 1:], first[:, 1:] + 0.5)
    # with autograd the vectors are built afresh (a cached graph would be freed by the first backward)
    scheme.prepare(coords, 1, grid_size=GRID).vectors.sum().backward()
    scheme.prepare(coords, 1, grid_size=GRID).vectors.sum().backward()
    assert len(calls) == 5


def test_train_mode_dropout_makes_the_vectors_stochastic():
    coords = grid_coords(GRID)
    scheme = _scheme(shift_prob=0.0).train()
    assert not torch.equal(scheme.prepare(coords, 1, GRID).vectors, scheme.prepare(coords, 1, GRID).vectors)
    plain = _scheme(shift_prob=0.0, dropout=0.0).train()
    assert torch.equal(plain.prepare(coords, 1, GRID).vectors, plain.prepare(coords, 1, GRID).vectors)
    # and evaluation is dropout-free: equal to the train-mode vectors of the same weights without dropout
    torch.testing.assert_close(scheme.eval().prepare(coords, 1, GRID).vectors, plain.prepare(coords, 1, GRID).vectors)


def test_larger_grids_encode_new_integers_and_grids_beyond_max_digits_raise():
    scheme = _scheme(pe_max_position=100).eval()  # 1 digit per axis: indices 0..9
    wide = scheme.prepare(grid_coords((3, 10)), 0, grid_size=(3, 10)).vectors[0]
    with torch.no_grad():
        torch.testing.assert_close(wide[9], scheme.encoder(torch.tensor([[0, 9]]))[0])  # (0, 9) read directly
    with pytest.raises(ValueError, match=r"grid_size \(3, 11\) has index 10, which needs 2 digits.*max_digits=1"):
        scheme.prepare(grid_coords((3, 11)), 0, grid_size=(3, 11))
    with pytest.raises(ValueError, match=r"coords hold index 12, which needs 2 digits.*max_digits=1"):
        scheme.rotate(torch.randn(1, 2, 1, 16), torch.tensor([[12.0, 0.0]]))
    with pytest.raises(ValueError, match="non-negative integer"):
        scheme.rotate(torch.randn(1, 2, 1, 16), torch.tensor([[1.5, 0.0]]))
    shape = {"img_size": (12, 20), "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 3}
    model = visionpe.VisionPEViT("seqpe", {**SMALL, "pe_max_position": 100}, dynamic_img_size=True, **shape).eval()
    model(torch.randn(1, 3, 12, 40))  # a 3 x 10 grid
    with pytest.raises(ValueError, match=r"grid_size \(3, 11\)"):
        model(torch.randn(1, 3, 12, 44))
    with pytest.raises(ValueError, match=r"grid_size \(12, 3\) has index 11"):
        _scheme(pe_max_position=100, grid_size=(12, 3))


def test_contrastive_label_is_the_nearest_candidate():
    side, count = 20, 8
    pivots, candidates, labels = contrastive_batch(300, count, side, 2, generator=torch.Generator().manual_seed(1))
    assert candidates.shape == (300, count, 2) and ((candidates >= 0) & (candidates < side)).all()
    for pivot, row, label in zip(pivots.tolist(), candidates.tolist(), labels.tolist(), strict=True):
        assert len({tuple(c) for c in row}) == count and pivot not in row  # distinct, never the pivot
        distances = [(y - pivot[0]) ** 2 + (x - pivot[1]) ** 2 for y, x in row]
        assert label == distances.index(min(distances))
    # the local-window recipe shows as rows whose candidates fit in a 14 x 14 box (uniform rows almost never do)
    spans = (candidates.amax(1) - candidates.amin(1)).amax(1)
    assert 0.1 < (spans < 14).float().mean() < 0.35


def test_hard_negatives_are_digit_edits_farther_than_the_nearest_candidate():
    import random

    rng = random.Random(0)
    found = _hard_negatives((23, 47), 200, 100, 2, nearest=9, rng=rng)
    assert len(found) > 50
    for y, x in found:
        assert 0 <= y < 100 and 0 <= x < 100 and (y - 23) ** 2 + (x - 47) ** 2 > 9
    # digit edits of "2347" keep more of its digits in place than the 0.4 of a uniform position
    same = [sum(a == b for a, b in zip(f"{y:02d}{x:02d}", "2347", strict=True)) for y, x in found]
    assert sum(same) / len(found) > 1.0


def test_contrastive_loss_is_cross_entropy_of_dot_products():
    scheme = _scheme(dropout=0.0, transfer_weight=0.0).train()
    losses = scheme.auxiliary_losses(generator=torch.Generator().manual_seed(3))
    assert set(losses) == {"seqpe_ct"}
    pivots, candidates, labels = contrastive_batch(4, 8, 100, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        e_pivot = scheme.encoder(pos2seq(pivots, 2))
        e_cand = scheme.encoder(pos2seq(candidates.flatten(0, 1), 2)).view(4, 8, -1)
    logits = torch.stack([e_cand[i] @ e_pivot[i] for i in range(4)])
    torch.testing.assert_close(losses["seqpe_ct"], F.cross_entropy(logits, labels), rtol=1e-5, atol=1e-6)


def test_transfer_loss_is_symmetric_kl_to_the_detached_training_grid():
    scheme = _scheme(dropout=0.0, contrastive_weight=0.0).train()
    losses = scheme.auxiliary_losses(generator=torch.Generator().manual_seed(4))
    assert set(losses) == {"seqpe_tr"}
    grid, student, offsets = scheme._transfer_positions(torch.Generator().manual_seed(4))
    origins = student[:, 0] - grid[offsets[:, 0]]
    assert ((origins[:, 0] >= 3) | (origins[:, 1] >= 5)).all()  # outside the 3 x 5 training grid
    assert (student[..., 0] - origins[:, None, 0] == grid[offsets][..., 0]).all() and (student < 100).all()
    total = 0.0
    with torch.no_grad():
        for window in range(2):
            s = scheme.encoder(pos2seq(student[window], 2)).view(6, 2, 16)  # (offsets, heads, head channels)
            t = scheme.encoder(pos2seq(grid[offsets[window]], 2)).view(6, 2, 16)
            for head in range(2):
                log_s = torch.log_softmax(s[:, head] @ s[:, head].T, -1)
                log_t = torch.log_softmax(t[:, head] @ t[:, head].T, -1)
                total += F.kl_div(log_s, log_t, log_target=True) + F.kl_div(log_t, log_s, log_target=True)
    torch.testing.assert_close(losses["seqpe_tr"], total / 4, rtol=1e-5, atol=1e-7)  # the reference's mean
    # the teacher is detached: the loss's gradient is that of the student's term alone
    scheme.zero_grad()
    losses["seqpe_tr"].backward()
    assert scheme.encoder.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"transfer loss needs windows.*expected pe_max_position >= 121"):
        _scheme(pe_max_position=100, grid_size=(5, 5), contrastive_weight=0.0).auxiliary_losses()


def test_shift_is_training_only_and_gives_image_b_the_window_b_mod_w():
    coords = grid_coords(GRID)
    scheme = _scheme(dropout=0.0, shift_prob=1.0, shift_windows=2, shift_origins=5)
    state = scheme.train().prepare(coords, 1, grid_size=GRID)
    assert state.vectors.shape == (2, 16, 32) and scheme._shifted
    assert set(scheme.auxiliary_losses()) == {"seqpe_ct"}  # no transfer after a shifted forward
    with torch.no_grad():
        for window in state.vectors[:, 1:]:  # each window is the grid moved to one of the pre-drawn origins
            origin = [o for o in scheme.shift_origin_table if torch.equal(window, scheme.encode(coords + o))]
            assert len(origin) == 1
    qk = torch.randn(2, 3, 2, 16, 16)
    modulation = state.layer(0)
    out = modulation.rotate(qk)
    for image in range(3):
        torch.testing.assert_close(out[:, image], qk[:, image] * modulation.table[:, image % 2])
    evaluated = scheme.eval().prepare(coords, 1, grid_size=GRID)
    assert evaluated.vectors.shape == (1, 16, 32) and not scheme._shifted
    torch.testing.assert_close(evaluated.vectors[0, 1:], scheme.encode(coords))
    # another grid than the training grid is not shifted
    assert scheme.train().prepare(grid_coords((4, 5)), 1, grid_size=(4, 5)).vectors.shape[0] == 1


def test_constructor_checks():
    with pytest.raises(ValueError, match="pe_max_position must be an int >= 4, got 2"):
        _scheme(pe_max_position=2)
    with pytest.raises(
        ValueError, match="embed_dim must be divisible by encoder_heads, got embed_dim=32, encoder_heads=3"
    ):
        _scheme(encoder_heads=3)
    with pytest.raises(ValueError, match=r"contrastive_candidates must be below the 100 positions.*got 100"):
        _scheme(pe_max_position=100, contrastive_candidates=100)
    with pytest.raises(ValueError, match="shift_windows must be <= shift_origins=4"):
        _scheme(shift_windows=8, shift_origins=4)
    with pytest.raises(ValueError, match="dropout must be a number in"):
        _scheme(dropout=1.0)
    with pytest.raises(ValueError, match="contrastive_weight must be a finite number >= 0"):
        _scheme(contrastive_weight=-0.1)
    names = _scheme().no_weight_decay()
    assert "cls_token_pos_embed" in names and "encoder.digit_embed.weight" in names
    assert "qk_bias" in names and "qk_weight" not in names  # the Linear weights decay, as in the reference


def test_classifier_training_step_adds_the_weighted_auxiliary_losses(monkeypatch):
    from visionpe.training import Classifier

    model_kwargs = {"img_size": (12, 20), "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2}
    options = {**SMALL, "contrastive_weight": 0.1, "transfer_weight": 0.2, "shift_prob": 0.0}
    plain_loss = {"num_classes": 4, "mixup": 0, "cutmix": 0, "label_smoothing": 0}
    classifier = Classifier("visionpe_vit_tiny_patch16_224", "seqpe", options, model_kwargs, **plain_loss).train()
    logged = {}
    monkeypatch.setattr(classifier, "log", lambda name, value, **kw: logged.__setitem__(name, value))
    images, targets = torch.randn(2, 3, 12, 20), torch.tensor([1, 3])
    torch.manual_seed(5)
    loss = classifier.training_step((images, targets), 0)
    torch.manual_seed(5)  # the same draws: dropout in the forward, then the losses' samples
    ce = F.cross_entropy(classifier(images), targets)
    terms = classifier.model.pos_schemes["seqpe"].auxiliary_losses()
    assert set(terms) == {"seqpe_ct", "seqpe_tr"} and all(t > 0 for t in terms.values())
    torch.testing.assert_close(loss, ce + 0.1 * terms["seqpe_ct"] + 0.2 * terms["seqpe_tr"])
    assert set(logged) == {"train/loss", "train/seqpe_ct", "train/seqpe_tr"}
    torch.testing.assert_close(logged["train/seqpe_ct"], terms["seqpe_ct"])
    assert math.isclose(logged["train/loss"].item(), loss.item())
    loss.backward()  # the losses reach the PE network
    assert classifier.model.pos_schemes["seqpe"].encoder.digit_embed.weight.grad.abs().sum() > 0
    # a scheme without losses of its own adds nothing
    plain = Classifier("visionpe_vit_tiny_patch16_224", "learned", None, model_kwargs, num_classes=4)
    assert plain.auxiliary_losses() == {}


def test_inference_encodes_positions_in_chunks_with_the_same_vectors(monkeypatch):
    import visionpe.rotary.seqpe as seqpe_module

    scheme = visionpe.create_pos_embed("seqpe", dim=32, num_heads=2, depth=1).eval()
    positions = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(7), indexing="ij"), -1).reshape(-1, 2)
    calls = []
    forward = scheme.encoder.forward
    monkeypatch.setattr(scheme.encoder, "forward", lambda digits: calls.append(len(digits)) or forward(digits))
    monkeypatch.setattr(seqpe_module, "_ENCODE_CHUNK", 16)
    with torch.no_grad():
        chunked = scheme.encode(positions.float())
    assert calls == [16, 16, 10]
    torch.testing.assert_close(chunked, scheme.encode(positions.float()), atol=1e-6, rtol=1e-6)
