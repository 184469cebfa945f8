"""The `Topology` value type: a weighted, directed communication graph over ranks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gossamer.errors import TopologyError

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Topology"]


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` or raise naming ``name``; bools are rejected."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int; got {value!r} of type {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def check_rank(value: object, size: int, name: str = "rank") -> int:
    """Return ``value`` as a rank in ``[0, size)`` or raise naming ``name``."""
    rank = check_int(value, name)
    if not 0 <= rank < size:
        raise ValueError(f"{name} must be in [0, {size}) for size {size}; got {rank}")
    return rank


def as_finite_matrix(value: Any, name: str, what: str) -> np.ndarray:
    """``value`` as a non-empty, finite 2-D float64 array (``what`` names its axes), or raise."""
    # A torch tensor, recognised without importing torch: topology stays pure numpy.
    if all(hasattr(value, attr) for attr in ("detach", "cpu", "numpy")):
        value = value.detach().cpu().numpy()
    if value is None or isinstance(value, str | bytes):
        raise TypeError(f"{name} must be a 2-D array of numbers; got {value!r}")
    _check_real(value, name)
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a 2-D array of numbers; got {exc}") from exc
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must be 2-D ({what}), non-empty; got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite; got a NaN or an infinity")
    return arr


def _check_real(value: Any, name: str) -> None:
    """Raise if ``value`` holds complex numbers, whose imaginary parts numpy would drop."""
    try:
        holds_complex = np.iscomplexobj(value)
    except (TypeError, ValueError):  # not an array: the conversion's own error says so
        return
    if holds_complex:
        raise TypeError(f"{name} must hold real numbers; got complex ones: {value!r:.80}")


def _holds_text(value: Any) -> bool:
    """Whether nested lists (or an array) hold strings, which numpy would parse as numbers."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "US"
    if isinstance(value, list | tuple):
        return any(isinstance(v, str | bytes) or _holds_text(v) for v in value)
    return False


def as_weight_matrix(weights: Any, name: str) -> np.ndarray:
    """Return a float64 copy of ``weights`` after checking it is a valid weight matrix."""
    # numpy would quietly turn None into NaN and "1" into 1.0.
    if weights is None or isinstance(weights, str | bytes):
        raise TypeError(f"{name} must be a matrix of numbers; got {weights!r}")
    if _holds_text(weights):
        raise TypeError(f"{name} must be a matrix of numbers; got text entries: {weights!r:.80}")
    _check_real(weights, name)
    try:
        arr = np.array(weights, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name} must be convertible to a float64 matrix; got {type(weights).__name__}: {exc}"
        ) from exc
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise TopologyError(f"{name} must be a 2-D square matrix; got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise TopologyError(f"{name} must have at least one row; got shape {arr.shape}")
    bad = np.argwhere(~np.isfinite(arr))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise TopologyError(f"{name} must be finite; got {arr[i, j]} at position ({i}, {j})")
    bad = np.argwhere(arr < 0)
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise TopologyError(f"{name} must be non-negative; got {arr[i, j]} at position ({i}, {j})")
    # Turn -0.0 into 0.0 so that equal matrices also have equal bytes, hence equal hashes.
    return arr + 0.0


@dataclass(frozen=True, eq=False, repr=False)
class Topology:
    """A weighted communication graph over ranks ``0 .. size-1``.

    ``W[i, j]`` is the weight rank ``j`` applies to what it receives from rank ``i``: a
    non-zero entry is the edge ``i -> j`` (``i`` sends to ``j``). Column ``j`` holds ``j``'s
    receive weights, row ``i`` holds ``i``'s send weights and the diagonal holds the self
    weights. One step of neighbour averaging with this topology is

    ``x_j <- W[j, j] * x_j + sum_{i in N_in(j)} W[i, j] * x_i``.

    Neighbour lists never contain the rank itself and are sorted ascending. The matrix is
    stored as a read-only float64 copy, so a ``Topology`` is a hashable value; ``name`` is
    only a label and takes no part in equality or hashing.

    Args:
        weights: Square, finite, non-negative matrix (anything ``np.array`` accepts).
        name: Human-readable label, e.g. ``"exponential(8, base=2)"``.

    Raises:
        TypeError: ``weights`` cannot be converted to floats, or ``name`` is not a ``str``.
        gossamer.errors.TopologyError: ``weights`` is not 2-D and square, is empty, or holds
            a NaN, an infinity or a negative entry.

    Example:
        >>> topo = Topology([[0.5, 0.5], [0.5, 0.5]], name="pair")
        >>> topo
        Topology(name='pair', size=2)
        >>> topo.recv_weights(1)
        (0.5, {0: 0.5})
    """

    weights: np.ndarray
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str; got {self.name!r}")
        arr = as_weight_matrix(self.weights, "weights")
        arr.setflags(write=False)
        # The dataclass is frozen, so the validated copy has to bypass __setattr__.
        object.__setattr__(self, "weights", arr)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self.weights.shape == other.weights.shape and bool(
            np.array_equal(self.weights, other.weights)
        )

    def __hash__(self) -> int:
        return hash((self.weights.shape, self.weights.tobytes()))

    def __repr__(self) -> str:
        return f"Topology(name={self.name!r}, size={self.size})"

    @property
    def size(self) -> int:
        """Number of ranks, i.e. the side of the weight matrix."""
        return int(self.weights.shape[0])

    @property
    def adjacency(self) -> np.ndarray:
        """Boolean matrix with ``A[i, j]`` true iff ``i != j`` and ``i`` sends to ``j``."""
        adj = self.weights > 0
        np.fill_diagonal(adj, False)
        return adj

    def in_neighbors(self, rank: int) -> tuple[int, ...]:
        """Return the ranks that send to ``rank`` (self excluded), sorted ascending.

        Args:
            rank: A rank in ``[0, size)``.

        Returns:
            The sources ``i != rank`` with ``W[i, rank] > 0``.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        rank = check_rank(rank, self.size)
        return tuple(int(i) for i in np.flatnonzero(self.weights[:, rank]) if i != rank)

    def out_neighbors(self, rank: int) -> tuple[int, ...]:
        """Return the ranks ``rank`` sends to (self excluded), sorted ascending.

        Args:
            rank: A rank in ``[0, size)``.

        Returns:
            The destinations ``j != rank`` with ``W[rank, j] > 0``.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        rank = check_rank(rank, self.size)
        return tuple(int(j) for j in np.flatnonzero(self.weights[rank, :]) if j != rank)

    def in_degree(self, rank: int) -> int:
        """Return the number of in-neighbours of ``rank`` (self excluded)."""
        return len(self.in_neighbors(rank))

    def out_degree(self, rank: int) -> int:
        """Return the number of out-neighbours of ``rank`` (self excluded)."""
        return len(self.out_neighbors(rank))

    def recv_weights(self, rank: int) -> tuple[float, dict[int, float]]:
        """Return the weights ``rank`` applies when it combines what it receives.

        Args:
            rank: A rank in ``[0, size)``.

        Returns:
            ``(W[rank, rank], {src: W[src, rank] for src in in_neighbors(rank)})``; the self
            weight is ``0.0`` when the diagonal entry is zero.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        sources = self.in_neighbors(rank)
        column = self.weights[:, rank]
        return float(column[rank]), {src: float(column[src]) for src in sources}

    def send_weights(self, rank: int) -> tuple[float, dict[int, float]]:
        """Return the weights attached to what ``rank`` sends.

        Args:
            rank: A rank in ``[0, size)``.

        Returns:
            ``(W[rank, rank], {dst: W[rank, dst] for dst in out_neighbors(rank)})``.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        destinations = self.out_neighbors(rank)
        row = self.weights[rank, :]
        return float(row[rank]), {dst: float(row[dst]) for dst in destinations}

    def without(
        self, ranks: int | Iterable[int], *, rule: str = "auto", connect: bool = False
    ) -> Topology:
        r"""Return the topology among the survivors when ``ranks`` are dead.

        Ranks keep their numbers, so that running ranks can keep using theirs: the result
        has the same size, every dead rank is isolated (``W[d, d] = 1``, no edges), and the
        survivors' block :math:`S` (the survivors' rows and columns, dead edges gone) is
        re-weighted by ``rule``:

        - ``"metropolis_hastings"`` (undirected graphs):
          :math:`S_{ij} = 1/(1 + \max(d_i, d_j))` on each surviving edge, with :math:`d_i`
          the degree among survivors, and :math:`S_{ii} = 1 - \sum_{j \ne i} S_{ij}`:
          symmetric, doubly stochastic.
        - ``"sinkhorn"`` (directed graphs): :math:`S = D_1 S^0 D_2`, the Sinkhorn-Knopp
          scaling of the surviving weights: doubly stochastic with the same edges (it exists
          when every survivor has a self weight and the survivors are strongly connected).
        - ``"receive"``: every survivor's receive weights (its column) scaled to sum 1:
          column stochastic, for consensus by convex combinations.
        - ``"send"``: every survivor's send weights (its row) scaled to sum 1: row
          stochastic, mass-conserving, for push-sum.
        - ``"auto"``: the rule that keeps what the original was: doubly stochastic and
          undirected -> ``"metropolis_hastings"``; doubly stochastic and directed ->
          ``"sinkhorn"``; else column stochastic -> ``"receive"``; else row stochastic ->
          ``"send"``.

        The survivors' graph must be connected (strongly, for a directed graph): otherwise
        a ``TopologyError`` names its components, or, with ``connect=True``, both directions
        of the ring through the survivors in ascending rank order are added where missing
        (with the original's smallest positive off-diagonal weight) before re-weighting.

        Args:
            ranks: The dead ranks: one rank or an iterable of ranks in ``[0, size)``. None
                (an empty iterable) returns this topology unchanged.
            rule: One of ``"auto"``, ``"metropolis_hastings"``, ``"sinkhorn"``,
                ``"receive"``, ``"send"``.
            connect: Add a ring through the survivors if they are not connected.

        Returns:
            The topology named ``"<name>.without([dead ranks])"``.

        Raises:
            TypeError: ``ranks`` is not a rank or an iterable of ints, ``rule`` is not a
                ``str`` or ``connect`` not a ``bool``.
            ValueError: a rank is out of range or repeated, every rank is dead, or ``rule``
                is unknown.
            gossamer.errors.TopologyError: the survivors are not connected (without
                ``connect``); ``"metropolis_hastings"`` on a directed graph; ``"auto"`` on a
                matrix that is neither row nor column stochastic; ``"sinkhorn"`` finds no
                doubly stochastic scaling.

        Example:
            >>> from gossamer.topology import ring
            >>> ring(4).without([3]).recv_weights(0)
            (0.6666666666666667, {1: 0.3333333333333333})
        """
        # survivors imports this module (and weights), so it is imported when first needed.
        from gossamer.topology.survivors import without

        return without(self, ranks, rule=rule, connect=connect)

    def to_networkx(self) -> nx.DiGraph:
        """Return the graph as an ``nx.DiGraph`` on nodes ``0 .. size-1``.

        Every non-zero ``W[i, j]`` becomes the edge ``(i, j)`` with attribute ``weight``;
        a positive diagonal entry becomes a self-loop.
        """
        import networkx as nx  # here, not at the top: 0.3 s of every rank's start-up

        graph = nx.DiGraph()
        graph.add_nodes_from(range(self.size))
        rows, cols = np.nonzero(self.weights)
        graph.add_weighted_edges_from(
            (int(i), int(j), float(self.weights[i, j])) for i, j in zip(rows, cols, strict=True)
        )
        return graph

    @classmethod
    def from_networkx(cls, graph: nx.Graph, *, weighted: bool = True, name: str = "") -> Topology:
        """Build a topology from a networkx graph whose nodes are exactly ``0 .. n-1``.

        An undirected graph contributes both directions of every edge. Weights are copied
        as they are, without normalisation.

        Args:
            graph: A ``nx.Graph`` or ``nx.DiGraph`` (not a multigraph).
            weighted: Use each edge's ``weight`` attribute (``1.0`` when missing); if
                ``False`` every edge gets ``1.0``.
            name: Label of the new topology.

        Returns:
            The topology with ``W[i, j]`` the weight of edge ``(i, j)``.

        Raises:
            TypeError: ``graph`` is not a networkx graph, or is a multigraph.
            gossamer.errors.TopologyError: ``graph`` is empty, its nodes are not exactly
                ``0 .. n-1``, or a weight is invalid.
        """
        import networkx as nx

        if not isinstance(graph, nx.Graph) or graph.is_multigraph():
            raise TypeError(f"graph must be a networkx Graph or DiGraph; got {type(graph)}")
        size = graph.number_of_nodes()
        if size == 0:
            raise TopologyError("graph must have at least one node; got an empty graph")
        nodes = list(graph.nodes)
        if any(isinstance(n, bool) for n in nodes) or set(nodes) != set(range(size)):
            raise TopologyError(f"graph nodes must be exactly 0..{size - 1}; got {nodes[:10]}")
        weights = np.zeros((size, size))
        for src, dst, data in graph.edges(data=True):
            value = data.get("weight", 1.0) if weighted else 1.0
            weights[src, dst] = value
            if not graph.is_directed():
                weights[dst, src] = value
        return cls(weights, name=name)
