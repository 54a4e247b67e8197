"""Names of the tensors an FP8 module casts (roles), and the role tuples the modules declare.

A module declares `forward_roles` (the tensors its forward casts: inputs and weights of its GEMMs, the tensors of FP8
attention) and `backward_roles` (the gradients its backward casts). A role's position in its tuple is its slot in the
module's forward or backward ScalingState: the order is the checkpoint format (extra_state), so it never changes for an
existing module.
"""
import enum


class Role(str, enum.Enum):
    """One tensor an FP8 module casts. A str enum: a role compares equal to its value ("input", "fc1_weight", ...),
    the names debug statistics are reported under."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"
    FC1_INPUT = "fc1_input"
    FC1_WEIGHT = "fc1_weight"
    FC2_INPUT = "fc2_input"
    FC2_WEIGHT = "fc2_weight"
    FC1_GRAD_OUTPUT = "fc1_grad_output"
    FC2_GRAD_OUTPUT = "fc2_grad_output"
    # FP8 attention (DotProductAttention under a recipe with fp8_dpa=True)
    ATTENTION_Q = "attention_q"
    ATTENTION_K = "attention_k"
    ATTENTION_V = "attention_v"
    ATTENTION_S = "attention_s"  # the softmax probabilities, made and cast inside the fused kernel
    ATTENTION_O = "attention_o"  # the output
    ATTENTION_DO = "attention_do"  # the output gradient
    ATTENTION_DP = "attention_dp"  # dS, the gradient of q kᵀ
    ATTENTION_DQ = "attention_dq"
    ATTENTION_DK = "attention_dk"
    ATTENTION_DV = "attention_dv"

    def __str__(self) -> str:
        return self.value


# (forward roles, backward roles) per module kind; the order is each ScalingState's slot order.
GEMM_ROLES = ((Role.INPUT, Role.WEIGHT), (Role.GRAD_OUTPUT,))
MLP_ROLES = ((Role.FC1_INPUT, Role.FC1_WEIGHT, Role.FC2_INPUT, Role.FC2_WEIGHT),
             (Role.FC1_GRAD_OUTPUT, Role.FC2_GRAD_OUTPUT))
ATTENTION_ROLES = ((Role.ATTENTION_Q, Role.ATTENTION_K, Role.ATTENTION_V, Role.ATTENTION_S, Role.ATTENTION_O),
                   (Role.ATTENTION_DO, Role.ATTENTION_DP, Role.ATTENTION_DQ, Role.ATTENTION_DK, Role.ATTENTION_DV))
