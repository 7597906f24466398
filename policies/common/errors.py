"""The root of every error specgov raises: :class:`SpecgovError`.

Every exception class in specgov's source derives from :class:`SpecgovError` (a test
walks the modules and checks it, and that this tree names each one). A class keeps the
builtin base its callers catch (``ValueError`` for bad input, ``OSError`` for a file or a
connection, ``click.ClickException`` for a CLI exit), so ``except ValueError`` and click's
exit codes see what they always saw; ``except SpecgovError`` catches everything specgov
raised on purpose, and nothing else.

At the IO seams an error also says whether to retry: :class:`TemporaryError` (it may
clear by itself: retry with backoff) or :class:`PermanentError` (retrying cannot help).
``GatewayError`` carries the same answer per instance (its ``temporary`` attribute: one
gateway call can fail either way).

The tree (module: class, its other bases in parentheses)::

    SpecgovError
    |-- TemporaryError
    |   |-- adapters.errors: TemporaryScrapeError (ScrapeError)
    |   |   `-- ResponseFormatError (ValueError)
    |   |-- controller.daemon.store_errors: StoreUnavailable
    |   |   |-- StoreCorrupt
    |   |   `-- StoreReplaced
    |   `-- controller.cli.control_client: DaemonUnreachableError (ControlClientError,
    |       ConnectionError), ControlServerError (ControlClientError)
    |-- PermanentError
    |   |-- adapters.errors: PermanentScrapeError (ScrapeError)
    |   |-- controller.daemon.store_errors: StoreRefused (StoreError)
    |   `-- controller.cli.control_client: ControlRequestError (ControlClientError,
    |       ValueError)
    |       `-- ControlAuthError
    |-- policies.common.types: PolicyTypeError (ValueError)
    |   |-- policies.common.step_table: FutureTableFormat
    |   |-- policies.common.roofline: RooflineError
    |   |-- policies.engine.adaptive_config: AdaptiveConfigError
    |   `-- policies.guardrails._common: GuardrailError
    |-- policies.daemon.spec: PolicySpecError (ValueError)
    |-- policies.daemon.schedules: PolicyStateError (ValueError)
    |-- policies.daemon.goodput.config: GoodputConfigError (ValueError)
    |-- policies.control.arrival_rate: ArrivalRateError (ValueError)
    |-- policies.control.fleet_mix: FleetMixError (ValueError)
    |-- policies.control.load_forecast: LoadForecastError (ValueError)
    |-- adapters.errors: ScrapeError
    |-- adapters.spool: SpoolError (ValueError), SpoolSecurityError (PermissionError)
    |-- adapters.spool_table: _Rejected (one table refused, inside the reader)
    |-- adapters.prometheus_text: _Unmodelled (the fast parser hands a line to the full one)
    |-- adapters.tp_sync: TpSyncError (ValueError)
    |-- adapters.launch_config: LaunchConfigError (ValueError)
    |-- controller.daemon.config_values: ConfigError (ValueError)
    |-- controller.daemon.control_api: ControlApiConfigError (ValueError),
    |   RequestError (ValueError)
    |-- controller.daemon.control_token: TokenFileError (ValueError)
    |-- controller.daemon.recommend: RecommendError (ValueError)
    |-- controller.daemon.store_errors: StoreError (ValueError)
    |   |-- StoreSchemaError
    |   `-- StoreRefused (PermanentError)
    |-- controller.daemon.store_records: BadRow (ValueError)
    |-- controller.cli.control_client: ControlAddressError (ValueError), ControlClientError
    |-- controller.cli.format: BadInput (click.ClickException: one line, exit 2)
    |-- controller.fleet.gateway: GatewayError (``temporary`` per instance)
    |-- controller.fleet.move: FleetFileError (ValueError)
    |-- simulator.catalog: CatalogError (ValueError)
    |-- simulator.priors: PriorOptionError (ValueError)
    |-- simulator.engine.acceptance: AcceptanceError (ValueError)
    |-- simulator.engine.acceptance_fit: AcceptanceFitError (ValueError)
    |-- simulator.engine.acceptance_runs: RunsError (ValueError)
    |-- simulator.engine.interface: EngineConfigError (ValueError)
    |-- simulator.engine.memory: MemoryPlanError (ValueError)
    |   `-- DoesNotFitError
    |-- simulator.engine.prefix_cache: HicacheError (ValueError)
    |-- simulator.workload.traces: TraceError (ValueError)
    |   `-- simulator.workload.trace_files: TraceFormatError
    |-- simulator.workload.synthetic: SyntheticSpecError (ValueError)
    |-- simulator.replay.closed_loop: ClosedLoopConfigError (ValueError)
    |-- simulator.replay.metrics: SloError (ValueError)
    |-- simulator.replay.oracle: OracleError (ValueError)
    |-- simulator.server.controls: SimServerError (ValueError)
    |-- simulator.server.endpoints: InvalidIncludeError (ValueError),
    |   RequestBodyError (ValueError)
    |-- simulator.server.generate: GenRequestError (ValueError)
    |-- simulator.server.live: LiveFeedClosed (RuntimeError), LiveFeedFull (RuntimeError)
    |-- simulator.server.replica: ReplicaError (RuntimeError)
    |-- simulator.server.driver: Stopped (the driver's stop signal)
    |-- simulator.planning.executor: ExecutorError (RuntimeError)
    |   `-- JobFailedError
    |-- simulator.planning.fleet_engine: FleetSimulationError (ValueError)
    |-- simulator.planning.fleet_spec: FleetSpecError (ValueError)
    |-- simulator.planning.prices: PriceError (ValueError)
    |-- simulator.planning.report: ReportError (ValueError)
    |-- simulator.planning.router: RouterSpecError (ValueError)
    |-- simulator.planning.search: SearchError (ValueError)
    `-- simulator.planning.sweep: SweepError (ValueError), WorkerMismatchError (RuntimeError)

Pure and at the bottom layer (no imports), so every layer may import it.
"""

from __future__ import annotations

__all__ = ["PermanentError", "SpecgovError", "TemporaryError"]


class SpecgovError(Exception):
    """The root of every error specgov raises (the tree: this module's docstring)."""


class TemporaryError(SpecgovError):
    """A failure that may clear by itself: retry later, with backoff."""


class PermanentError(SpecgovError):
    """A failure retrying cannot fix: the input, the key or the file must change."""
