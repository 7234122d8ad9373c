import pytest
import torch

from fscale.readback import to_list


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3),
        torch.tensor([1, 2, 3]),
        torch.arange(6).view(2, 3),
        torch.tensor([0.5, -1.25], dtype=torch.float64),
        torch.tensor([True, False]),
        torch.empty(0, 2),
    ],
)
def test_to_list_equals_tolist_on_plain_tensors(t):
    assert to_list(t) == t.tolist()


def test_to_list_reads_values_made_inside_a_func_transform():
    # Inside torch.func.grad every tensor the function makes is a transform wrapper; the host
    # must still read its values (a key's words, token counts) exactly.
    seen = []

    def f(x):
        counts = (x > 0).to(torch.int64).view(2, 2)
        seen.append(to_list(counts))
        seen.append(to_list(counts.sum()))
        return (x * x).sum()

    torch.func.grad(f)(torch.tensor([1.0, -2.0, 3.0, 0.0]))
    assert seen == [[[1, 0], [1, 0]], 2]
