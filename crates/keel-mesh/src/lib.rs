//! One set of numbers for the app and the mesh.
//!
//! A service that runs in a mesh has two places where a call's timeout,
//! retries and ejection can live: Keel's pipeline in the process, and the
//! sidecar (Istio's `VirtualService` and `DestinationRule`). Each is easy to
//! get wrong on its own, and the two together multiply: Keel's 3 tries
//! through a sidecar that tries each 3 times are 9 calls to a dependency
//! that is already failing. This crate applies the rules Keel's pipeline
//! enforces when it is built to the mesh's resources, and translates Keel's
//! policy into those resources.
//!
//! [`check`] reads resources and reports, per route:
//! - **retries-fit-timeout** (error): tries × `perTryTimeout` plus Envoy's
//!   back-off must fit in the route's `timeout`, the same rule
//!   ([`keel_policy::pipeline::attempts_fit`]) the pipeline applies. Istio's
//!   `attempts` counts the retries *after* the first try, and a route
//!   without `retries` is retried twice by default; both are counted.
//! - **retry-non-idempotent** (warning): a condition that fires after the
//!   upstream may have done the work (`5xx`, `reset`, ...) on a route that
//!   also carries POST.
//! - **ejection-cap** (error): `maxEjectionPercent: 100`, which turns a
//!   degraded dependency into a total outage.
//! - **weights** and **unknown-subset** (errors): weights that do not add
//!   up to 100, a subset the host's rule does not define.
//! - with Keel's [`Policies`]: **retries-multiply** when both layers retry
//!   one dependency, **splits-multiply** when both split its calls by
//!   weight (a canary's share becomes the product), **timeouts-disagree**
//!   when Keel waits longer than the mesh lets a call run,
//!   **policy-invalid** when Keel's own policy does not build.
//!
//! [`export`] writes the `VirtualService` and `DestinationRule` equivalent
//! to one dependency's policy: the total timeout as the route's `timeout`,
//! Keel's attempts as `attempts + 1` tries with the attempt timeout per
//! try, retried only on failures that prove the request never arrived
//! unless Keel's policy says the calls are idempotent, the balancer's
//! ejection as outlier detection, and Keel's weighted subsets as the
//! route's weighted destinations (percentages that add up to 100) with the
//! rule's subsets selecting their pods (`version: <name>` by default).
//!
//! ```
//! let yaml = r#"
//! apiVersion: networking.istio.io/v1
//! kind: VirtualService
//! metadata: { name: orders }
//! spec:
//!   hosts: [orders.internal]
//!   http:
//!     - timeout: 2s
//!       retries: { attempts: 2, perTryTimeout: 700ms, retryOn: "connect-failure" }
//!       route: [{ destination: { host: orders.internal } }]
//! "#;
//! let resources = keel_mesh::parse(yaml)?;
//! let report = keel_mesh::check(&resources, &keel_mesh::Policies::default());
//! // 3 tries of 700 ms (2 retries after the first) cannot fit in 2 s.
//! assert!(report.has_errors());
//! # Ok::<(), keel_mesh::MeshError>(())
//! ```

mod check;
mod duration;
mod error;
mod export;
pub mod istio;
mod policy;

pub use check::{Finding, Report, Rule, Severity, check, envoy_backoff};
pub use duration::IstioDuration;
pub use error::MeshError;
pub use export::{MAY_HAVE_ARRIVED, NEVER_ARRIVED, export};
pub use istio::{Resource, parse, to_yaml};
pub use policy::{DependencyPolicy, Policies, SubsetPolicy, same_host};
