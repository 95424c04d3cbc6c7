// dtk::optim — Distributed Shampoo (Shi et al. 2023): blocked Kronecker-factored preconditioning
// with grafting, the preconditioner work of the blocks split over the ranks, and one all-gather of
// the search directions per step.
//
// Per parameter: size-1 dims are dropped; adjacent dims are merged, from the last one backwards,
// while their product stays <= max_preconditioner_dim; every merged dim is split into blocks of at
// most that size. A block of order K (its number of dims) has one Kronecker factor per dim,
//   F_k = beta2 F_k + (1 - beta2) G_(k) G_(k)^T     (beta2 = 1: F_k += G_(k) G_(k)^T, AdaGrad's sum)
// with G_(k) the block of the raw gradient unfolded along dim k, and an inverse root
// R_k = (F_k + eps I)^(-1/p), p = 2K unless overridden, computed as the reference does at step
// start_preconditioning_step and then at every step t > start that is a multiple of
// precondition_frequency (identity before the first computation); start >= frequency.
//
// One step (t counts from 1; every block on its owner):
//   M = beta1 M + (1 - beta1) G, Mh = M / (1 - beta1^t)     (beta1 = 0: Mh = G)
//   D_graft = grafting step of Mh (sgd: Mh; adagrad: Mh / (sqrt(sum G^2) + graft_eps); rmsprop:
//             Mh / (sqrt(EMA G^2) + graft_eps); adam: as rmsprop with EMA / (1 - graft_beta2^t))
//   t <  start: D = D_graft
//   t >= start: P = Mh x_0 R_0 x_1 R_1 ... (mode products), D = P ||D_graft|| / ||P|| per block
//               (grafting none, or grafting_scope diagonal: D = P)
//   weight decay "decoupled": D = D + wd W (W the block's weights before the step)
//   momentum:   B = mu B + D; D = nesterov ? D + mu B : B
// then every rank applies p = p - lr D. Weight decay "l2" instead adds wd W to the gradient G
// before anything above sees it. Both as the reference implementation does (distributed_shampoo.py).
//
// Inverse roots by symmetric eigendecomposition (batched over blocks of one size) in the factor
// dtype: with mu = eig(F) + eps ascending, every mu is shifted up by eps - mu_0 when mu_0 < eps,
// then R = V diag(mu^(-1/p)) V^T (ops::inverse_roots; the rule is ops::inverse_root_scales). A block whose computation fails (the solver, or a non-finite
// result) is retried in f64 (ops::inverse_root); if that fails too it keeps its previous root, with
// a warning; its fourth consecutive failure is an Error naming the block. A NaN or Inf in a factor
// is an Error naming the parameter. root_method "newton" uses the coupled Newton iteration instead.
//
// root_method "qr" is the reference's warm-started eigendecomposition (QREigendecompositionConfig):
// each factor keeps an eigenbasis Q. At a root step, with A = F + eps I and B = Q^T A Q: while
// fewer than qr_max_iterations iterations have run and ||B - diag B||_F > qr_tolerance ||B||_F
// (tolerance 0, the default and the reference's: always qr_max_iterations), Q = qr(A Q)
// (Householder) and B = Q^T A Q; then Q's columns are sorted by the estimates diag B (stable).
// For the roots (a dtk extension: the reference computes roots by eigh or Newton) Q is zero until
// the first root, which is a full eigh; the estimates, shifted by the rule above, give
// R = Q diag(mu^(-1/p)) Q^T, and Q is kept in DESCENDING order of the estimates. In ascending
// order, simultaneous iteration pulls the first column, the smallest eigenvector, towards the
// largest, spoiling the small-eigenvalue directions that the root amplifies; in descending order
// each column converges at the rate of its eigenvalue gap. Measured on a drifting 24 x 24 factor,
// roots every 10 steps, 1 iteration, tolerance 0.01 (Shampoo.QrRootAccuracy): root error against
// the full eigh 2.3e-2 to 3.0e-2 descending, 0.16 to 0.29 ascending. The eigenvalue-corrected
// bases follow the reference exactly instead (below). A block whose estimate is not finite
// retries as above (f64 eigh) and restarts from a full eigh at its next root.
//
// root_spread S > 1 spreads the root computations over each period: the blocks are divided into
// S phases (greedily by their root cost, sum of b_k^3 over the factors, 0 for diagonal blocks,
// largest first, each to the cheapest phase; world-size independent), and a block of phase j
// recomputes its roots at the start step and then at every step t > start with (t - j floor(f/S))
// a multiple of the frequency f. Each root step then does about 1/S of the work; every root is still at most f steps old.
// Within a phase the blocks are assigned to ranks as below, so every rank's share of each
// phase is balanced. S = 1 is the reference's schedule.
//
// Preconditioners (preconditioner; "root" is all of the above):
// - eigenvalue_corrected (SOAP, Vyas et al. 2024; Meta's EigenvalueCorrectedShampoo): the same
//   factors, but at the root steps the eigenbases Q_k of F_k / bc are computed instead of roots
//   (ops::eigenbases; root_method eigh: columns by ascending eigenvalue; qr, Meta's
//   DefaultSOAPConfig: the QR iterations above from the current bases, the first time from the
//   identity, columns by ascending estimate: the reference's order, which matters because the
//   second moment below is positional); Q_k = I before. The bases and the second moment are
//   kept in basis_dtype (f32, the reference's default, or f64: its
//   factor_matrix_eigenvectors_dtype and corrected_eigenvalues_dtype), the rotations below done
//   in it. Checkpoints of dtk before this order (their optimizer config has no
//   "eigenbasis_order") kept qr bases in descending order: restored, each basis's columns and
//   each block's second moment are reversed (the same preconditioner, in ascending order).
//   Every step: Gr = G x_k Q_k^T (G the raw, L2-augmented gradient; every mode into its basis),
//   V = b V + (1 - b) Gr^2 (b = ec_beta2, default beta2; b = 1: the sum), and
//   P = [(Mh x_k Q_k^T) / (sqrt(V / (1 - b^t)) + e)] x_k Q_k (e = ec_epsilon, default epsilon;
//   no bias correction when b = 1 or use_bias_correction is off), grafted as above; before the
//   start step the grafting direction when grafting is set, else P with Q = I (Adam).
// - spectral (Muon, Jordan et al. 2024; Meta's SpectralDescent): a parameter of 2 or more dims is
//   blocked as [d0, product of the rest] (shampoo_blocking's matrix view), and every order-2 block
//   [r, c] takes, every step, P = s U V^T of Mh: quintic Newton-Schulz iterations (X = Mh /
//   max(||Mh||_F, 1e-8); newton_schulz_steps times A = X X^T, X = 3.4445 X + (-4.7750 A +
//   2.0315 A^2) X, in the mirrored form X^T X, X B for tall blocks), or exactly (X (X^T X)^(+1/2)
//   in f64, the pseudo-inverse root); s = 1, max(1, r/c)^(1/2) (muon) or 0.2 sqrt(max(r, c))
//   (rms, Moonlight); grafted as above. No factors, no root steps.
// - dion ("Dion": Ahn et al. 2025, microsoft/dion's dion_reference.py, power_iters 1): every
//   parameter of 2 or more dims of size > 1 not named by diagonal_params is one matrix X [m, n]
//   (as [d0, rest]; no blocks, shampoo_dion.cpp), with a buffer M and a right factor Q [n, r]
//   (N(0, 1) from a fixed stream per parameter), r = dion_rank(m, n); every step
//     M += G; P = orth(M Q) (Householder); R = M^T P; M -= (1 - beta1) P R^T;
//     Q = R / (||R_j|| + 1e-8) per column (a zero column keeps its Q_j); X = X (1 - lr wd) - lr s P Q^T
//   on M^T (Q [m, r]) when m < n; s = spectral_scale_factor (fan by default: sqrt(m / n)); l2
//   decay adds wd X to M. No grafting, momentum or root steps for these. dion_sync factors:
//   their gradients arrive unreduced (each replica's own contribution, times the replica count:
//   its estimate of the mean), each replica keeps its own M, and M Q and M^T P are averaged over
//   the replicas (two all-reduces for all matrices together), which makes P, R and the update
//   those of one process fed the mean gradient; sharded rows: M Q's rows gathered, M^T Q and M^T
//   P summed over the shard group.
// - root_method pseudo_inverse: roots of F / bc by eigh with no epsilon, eigenvalues at or
//   below max(rank_atol, rank_rtol w_max) given the power 0 (ops.h).
// Blocks of parameters named in diagonal_params, and spectral's blocks of order other than 2,
// are diagonal: no factors, D = the grafting direction (grafting none: Mh). factor_update_every K
// updates the factors at steps 1, K + 1, 2K + 1, ... only (Google's statistics_compute_steps,
// not in Meta's reference), their bias correction counting those updates.
//
// Distribution: the blocks are assigned to the ranks of a group greedily, largest first (by number
// of elements, ties by block order), each to the least-loaded rank (ties: the lowest rank), one
// root phase at a time: deterministic, the same on every rank. Only the owner keeps a block's state and computes its
// factors, root and search direction; the directions travel in one all_gather_v per step (f32 or
// bf16) over one flat buffer, and every rank applies the whole update. trainers_per_group g splits
// the world into world/g groups of g consecutive ranks that each compute every block (no
// communication between groups; g = 1: every rank computes everything, no communication at all).
//
// Use from a training loop: step() must be called on every rank of the communicator, with the
// same (already aggregated) gradients and lr everywhere (but Dion's matrices' with dion_sync
// factors and replicas given: each rank's own contribution); it communicates (one all_gather_v within
// the group per step when the group has more than one rank, and on root steps one small
// all-reduce so that every rank raises the same error). Its buffers live on the parameters'
// device, so the communicator must accept that device (nccl for cuda, mpi or local for cpu).
//
// State and checkpoints: state() lists the tensors this rank holds, named by block so that the
// names do not depend on the world size:
//   shampoo/<param>/block<i>/factor<k>      [b_k, b_k] factor dtype   (k < order)
//   shampoo/<param>/block<i>/root<k>        [b_k, b_k] f32
// (factors and roots are exactly symmetric, syrk and ops::symmetrize: their PlacedTensor is
// marked symmetric, and checkpoints store them packed)
//   shampoo/<param>/block<i>/eigvecs<k>     [b_k, b_k] factor dtype (root_method qr: Q, columns)
//   shampoo/<param>/block<i>/eigvecs<k>     [b_k, b_k] f32 (eigenvalue-corrected: Q_k)
//   shampoo/<param>/block<i>/corrected_second_moment  block shape, f32 (eigenvalue-corrected: V)
//   shampoo/<param>/block<i>/graft          block shape, f32 (adagrad, rmsprop, adam grafting)
//   shampoo/<param>/block<i>/filtered_grad  block shape, f32 (beta1 > 0)
//   shampoo/<param>/block<i>/momentum       block shape, f32 (momentum > 0)
//   shampoo/<param>/block<i>/root_failures  i64 [1] on the host (consecutive failed roots or
//                                           eigenbases; blocks with factors)
// (spectral and diagonal blocks: graft, filtered_grad, momentum only)
//   dion/<param>/momentum                   [m, n] f32 (Dion's M; dion_sync factors over replicated
//                                           parameters: per rank, Resize::mean; sharded: by rows)
//   dion/<param>/q                          [n, r] f32, or [m, r] when m < n (by rows when sharded)
//   step                                    i64 [1] on the host, replicated
// i is the block's index in the row-major grid of the parameter's blocks. A block's tensors are
// owned by (written by) its owner in group 0 (ranks [0, g)); ranks of other groups hold
// identical copies, placed replicated there (restored by name, never written), so
// ckpt::save_state writes every tensor once and ckpt::load_state restores every copy. A state
// saved on any world size restores on any other: the blocking does not depend on it, and each
// rank reads the blocks it now owns. Over sharded parameters (rows given: fsdp-train) the blocks
// are still the whole parameters' blocks, so the state and its names are those of the
// replicated optimizer, on any shard count: comm is then the shard group, and every step first
// gathers every rank's rows of the gradients (and of the weights, with weight decay) with one
// all_gather_v, so that each owner has its blocks whole (the reference's lossless fully-sharded
// distribution); each rank applies the directions of its own rows. Memory beyond the replicated
// optimizer's: the gathered gradients (and weights), 4 bytes per parameter element each.
// Checkpoints of older dtk, whose fsdp-train cut the blocks from the shards, lack these names:
// Resize::if_present leaves the optimizer fresh (fsdp-train says so and starts Shampoo afresh).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/optimizer.h"

namespace dtk::optim {

// Inverse roots by eigendecomposition, coupled Newton iteration, or warm-started QR iterations
// (ops::inverse_roots).
using ops::RootMethod;
enum class Grafting { none, sgd, adagrad, rmsprop, adam };
DTK_ENUM_NAMES(Grafting, {Grafting::none, "none"}, {Grafting::sgd, "sgd"}, {Grafting::adagrad, "adagrad"},
               {Grafting::rmsprop, "rmsprop"}, {Grafting::adam, "adam"})
// Which blocks take the grafting norm: all (Meta's grafting), or only the diagonal ones, whose
// direction the grafting method is (diagonal_params, spectral's blocks of order != 2), the
// preconditioned blocks going ungrafted: Muon as its papers and Dion's run it, AdamW on the
// embeddings, the output layer and the vectors (Meta's two parameter groups, one option here).
enum class GraftingScope { all, diagonal };
DTK_ENUM_NAMES(GraftingScope, {GraftingScope::all, "all"}, {GraftingScope::diagonal, "diagonal"})
// "decoupled" (the reference's default): wd W added to the search direction, before momentum;
// "l2": wd W added to the gradient, before the factors, grafting and filtering see it.
enum class WeightDecayType { decoupled, l2 };
DTK_ENUM_NAMES(WeightDecayType, {WeightDecayType::decoupled, "decoupled"}, {WeightDecayType::l2, "l2"})

// What a block's search direction is made of (shampoo.h, "Preconditioners"): inverse roots of
// the Kronecker factors (Shampoo), Adam in the factors' eigenbases (eigenvalue-corrected
// Shampoo, SOAP), or the orthogonalised filtered gradient (spectral descent, Muon).
// Dion (Ahn et al. 2025): Muon's orthonormalised update of each matrix by one warm-started power
// iteration of rank r, with error feedback (shampoo.h, "Dion").
enum class Preconditioner { root, eigenvalue_corrected, spectral, dion };
DTK_ENUM_NAMES(Preconditioner, {Preconditioner::root, "root"},
               {Preconditioner::eigenvalue_corrected, "eigenvalue-corrected"}, {Preconditioner::spectral, "spectral"},
               {Preconditioner::dion, "dion"})
// dion: how the data-parallel ranks agree on an update. factors: each rank keeps its own buffer
// M_i and only the power iteration's factors P and R are all-reduced (the reference's
// replicate_mesh_grad_sync); gradients: the matrices' gradients are all-reduced as every other
// parameter's, and M is the same on every rank.
enum class DionSync { factors, gradients };
DTK_ENUM_NAMES(DionSync, {DionSync::factors, "factors"}, {DionSync::gradients, "gradients"})
// spectral: U V^T by Newton-Schulz iterations (quintic) or exactly (eigh of X^T X in f64).
enum class SpectralMethod { newton_schulz, exact };
DTK_ENUM_NAMES(SpectralMethod, {SpectralMethod::newton_schulz, "newton-schulz"}, {SpectralMethod::exact, "exact"})
// spectral, dion: the orthogonalised block [r, c] times 1 (none), max(1, r/c)^(1/2) (muon, Jordan
// et al.), 0.2 sqrt(max(r, c)) (rms, Moonlight: AdamW's update RMS) or (r/c)^(1/2) (fan: the
// reference Dion's fan_out / fan_in); auto: muon for spectral, fan for dion.
enum class SpectralScale { auto_, none, muon, rms, fan };
DTK_ENUM_NAMES(SpectralScale, {SpectralScale::auto_, "auto"}, {SpectralScale::none, "none"},
               {SpectralScale::muon, "muon"}, {SpectralScale::rms, "rms"}, {SpectralScale::fan, "fan"})

struct ShampooConfig {
  Kind name = Kind::shampoo;  // always shampoo: an optimizer's config() names the optimizer
  Preconditioner preconditioner = Preconditioner::root;
  // blocking
  int64_t max_preconditioner_dim = 1024;
  // Kronecker factors
  double beta2 = 0.95;              // factor EMA; 1: the AdaGrad sum
  DType factor_dtype = DType::f32;  // f32 | f64
  double epsilon = 1e-12;           // added to the factors' eigenvalues (eps I)
  bool use_bias_correction = true;  // Mh = M / (1 - beta1^t); factors / (1 - beta2^t) when beta2 < 1
  // inverse roots
  int64_t precondition_frequency = 100;
  int64_t start_preconditioning_step = -1;  // -1: precondition_frequency
  double exponent_override = 0;             // 0: R_k = F_k^(-1/(2 order)); else F_k^(-1/exponent_override)
  RootMethod root_method = RootMethod::eigh;
  int newton_max_iters = 100;
  double newton_tolerance = 1e-6;
  int qr_max_iterations = 1;    // qr: at most this many QR iterations per root step
  double qr_tolerance = 0;      // qr: none once ||B - diag B||_F <= tol ||B||_F (0: always max_iterations)
  int64_t root_spread = 1;      // root computations spread over this many phases of each period
  double rank_rtol = -1;        // root_method pseudo-inverse: relative rank cutoff (< 0: n * machine epsilon)
  double rank_atol = 0;         // root_method pseudo-inverse: absolute rank cutoff
  int64_t factor_update_every = 1;  // the factors take the gradient of every K-th step only
  // eigenvalue-corrected
  double ec_beta2 = -1;    // the corrected second moment's decay (< 0: beta2)
  double ec_epsilon = -1;  // added to its square root (< 0: epsilon)
  DType basis_dtype = DType::f32;  // the eigenbases' and the corrected second moment's precision: f32 | f64
  // spectral
  SpectralMethod spectral_method = SpectralMethod::newton_schulz;
  int newton_schulz_steps = 5;
  SpectralScale spectral_scale = SpectralScale::auto_;
  // dion
  double dion_rank_fraction = 0.25;  // r = ceil(fraction min(m, n)) ...
  int64_t dion_rank = 0;             // ... or this (capped at min(m, n)) when > 0
  DionSync dion_sync = DionSync::factors;
  // parameters whose name contains one of these take the grafting (diagonal) direction only
  std::vector<std::string> diagonal_params{};
  // grafting
  Grafting grafting = Grafting::adam;
  GraftingScope grafting_scope = GraftingScope::all;
  double grafting_beta2 = 0.95;   // rmsprop, adam
  double grafting_epsilon = 1e-8;
  // first moment, momentum, weight decay
  double beta1 = 0.9;  // gradient filtering (0: none)
  double momentum = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
  WeightDecayType weight_decay_type = WeightDecayType::decoupled;
  // distribution
  int trainers_per_group = 0;                // 0: the whole world in one group
  DType communication_dtype = DType::f32;  // search directions all-gathered as f32 | bf16

  void validate() const;  // UsageError naming the option
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ShampooConfig, name, preconditioner, max_preconditioner_dim, beta2, factor_dtype, epsilon,
                                                use_bias_correction, precondition_frequency,
                                                start_preconditioning_step, exponent_override, root_method,
                                                newton_max_iters, newton_tolerance, qr_max_iterations, qr_tolerance,
                                                root_spread, rank_rtol, rank_atol, factor_update_every, ec_beta2,
                                                ec_epsilon, basis_dtype, spectral_method, newton_schulz_steps, spectral_scale,
                                                dion_rank_fraction, dion_rank, dion_sync,
                                                diagonal_params, grafting, grafting_scope, grafting_beta2, grafting_epsilon, beta1,
                                                momentum, nesterov, weight_decay, weight_decay_type,
                                                trainers_per_group, communication_dtype)


// The blocking of a parameter of this shape (world-size independent).
struct ShampooBlocking {
  Shape merged;                              // size-1 dims dropped, small dims merged ([] for a scalar)
  std::vector<Shape> block_shapes;           // row-major over the grid of blocks ([] for a scalar)
  std::vector<std::vector<int64_t>> offsets;  // each block's offset in `merged`
};
// matrix_view (spectral): a tensor of 2 or more dims (of size > 1) is [d0, product of the rest].
ShampooBlocking shampoo_blocking(const Shape& shape, int64_t max_preconditioner_dim, bool matrix_view = false);

// Dion (preconditioner dion): a parameter is one of its matrices when it has 2 or more dims of
// size > 1 and diagonal_params does not name it; it is viewed as [d0, product of the rest].
bool dion_matrix(const ShampooConfig& c, const std::string& name, const Shape& shape);
// Its rank for a [m, n] matrix: ceil(dion_rank_fraction min(m, n)), or dion_rank, at most min(m, n).
int64_t dion_rank(const ShampooConfig& c, int64_t m, int64_t n);
// Per parameter: Dion aggregates its gradient itself (dion_sync factors), so the data-parallel
// synchronisation must leave it out (each rank keeps its own contribution).
std::vector<char> dion_local_gradients(const ShampooConfig& c, const std::vector<nn::Param>& params);
// The parameter's name contains one of diagonal_params.
bool named_diagonal(const ShampooConfig& c, const std::string& name);

// Greedy assignment: sizes largest first (ties by index), each to the least-loaded of `ranks`
// (ties by lower rank). Returns the rank of each item.
std::vector<int> shampoo_assign(const std::vector<int64_t>& sizes, int ranks);

// The root phase of every block (root_spread phases): shampoo_assign of the blocks' root costs
// (sum of b_k^3 over their dims; blocks in parameter order, each parameter's in grid order).
std::vector<int> shampoo_root_phases(const std::vector<Shape>& block_dims, int64_t spread);

// The optimizer over `params` (f32, all on one device). Collective over comm (it may split it).
// rows: as make_optimizer's; sharded parameters (every one, over comm, this rank's rows) are
// gathered every step (above). replicas (Parallelism::replica_comm): the ranks whose own
// gradients of Dion's matrices Dion aggregates (dion_sync factors; null: they arrive aggregated).
std::unique_ptr<Optimizer> make_shampoo(const ShampooConfig& cfg, const std::vector<nn::Param>& params,
                                        comm::Communicator& comm, const std::vector<Rows>& rows = {},
                                        comm::Communicator* replicas = nullptr);

}  // namespace dtk::optim
