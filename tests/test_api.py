"""The Python API as README shows it (issue 18, item 8): ``out.logits`` with labels whenever no backward can follow
(eval mode, torch.no_grad()), and None in a training forward, where the fused loss never builds them."""

import torch

import moe_tune


def test_logits_with_labels_outside_training_none_in_training(tiny_checkpoint):
    model = moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32, kernels="torch")
    ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    out = model(input_ids=ids, labels=ids)
    plain = model(input_ids=ids).logits
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    # The loss is still the fused one; over these logits it is plain cross-entropy of the shifted labels.
    ref = torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, plain.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).logits, plain, rtol=0, atol=0)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and out.loss.requires_grad  # training: no batch x seq x vocab tensor
    assert model(input_ids=ids, labels=ids, return_logits=True).logits is not None
    model.eval()
    assert model(input_ids=ids, labels=ids, return_logits=False).logits is None
