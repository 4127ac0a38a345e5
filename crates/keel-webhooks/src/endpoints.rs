//! Managing webhook endpoints: registration with URL checks, secret
//! rotation without downtime, enabling and disabling.
//!
//! # Rotating a secret
//!
//! A customer cannot switch their receiver to a new secret at the very
//! moment we switch our sender. So [`Endpoints::rotate_secret`] adds a new
//! secret and keeps the old one signing for a grace period (default 24
//! hours): every delivery carries one signature per active secret
//! (`webhook-signature: v1,<old> v1,<new>`), a receiver that knows either
//! secret accepts it, and once the grace period is over only the new secret
//! signs. At most two secrets are ever active.

use std::time::Duration;

use keel_store::StoreError;
use keel_store::{WebhookEndpoint, WebhookEndpointStore, WebhookFormat, WebhookSecret};

use super::WallClock;
use super::error::WebhookError;
use super::sealing::SecretSealer;
use super::signing::Secret;
use super::ssrf::SsrfGuard;

/// How long the previous secret keeps signing after a rotation: 24 hours.
pub const DEFAULT_ROTATION_GRACE: Duration = Duration::from_secs(24 * 3600);
/// The longest endpoint description accepted, in characters.
pub const MAX_DESCRIPTION_LEN: usize = 1024;
/// The most event-type filters on one endpoint.
pub const MAX_EVENT_TYPES: usize = 100;

/// What to register.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEndpoint {
    /// The URL to POST deliveries to.
    pub url: String,
    /// A description for humans.
    pub description: String,
    /// Event types (`order.paid`) or prefixes (`order.*`); empty for all.
    pub event_types: Vec<String>,
    /// The id (default: a new `ep_<uuidv7>`).
    pub id: Option<String>,
    /// The first secret (default: a new random one).
    pub secret: Option<Secret>,
    /// The tenant that owns it (default: none).
    pub tenant: String,
    /// How deliveries go on the wire (default: Standard Webhooks).
    pub format: WebhookFormat,
}

impl NewEndpoint {
    /// An endpoint at `url`, subscribed to every event type.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            description: String::new(),
            event_types: Vec::new(),
            id: None,
            secret: None,
            tenant: String::new(),
            format: WebhookFormat::default(),
        }
    }

    /// Sets how deliveries go on the wire.
    pub fn format(mut self, format: WebhookFormat) -> Self {
        self.format = format;
        self
    }

    /// Sets the owning tenant.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = tenant.into();
        self
    }

    /// Sets the description.
    pub fn description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// Subscribes to these event types or `prefix.*` patterns only.
    pub fn event_types<I, T>(mut self, types: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.event_types = types.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the id.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the first secret.
    pub fn secret(mut self, secret: Secret) -> Self {
        self.secret = Some(secret);
        self
    }
}

/// Endpoint management and the delivery log (see also the `log` methods:
/// [`deliveries`](Self::deliveries), [`attempts`](Self::attempts),
/// [`resend`](Self::resend), [`replay`](Self::replay)).
#[derive(Debug, Clone)]
pub struct Endpoints<S> {
    pub(super) store: S,
    guard: SsrfGuard,
    sealer: SecretSealer,
    pub(super) clock: WallClock,
}

impl<S: WebhookEndpointStore> Endpoints<S> {
    /// Manages the endpoints in `store`, checking URLs with `guard`.
    pub fn new(store: S, guard: SsrfGuard) -> Self {
        Self {
            store,
            guard,
            sealer: SecretSealer::plaintext(),
            clock: WallClock::system(),
        }
    }

    /// Seals secrets with `sealer` before they are stored (default: stored
    /// as given). Give the delivery worker the same sealer.
    pub fn sealer(mut self, sealer: SecretSealer) -> Self {
        self.sealer = sealer;
        self
    }

    /// The clock for timestamps (default: the system's).
    pub fn clock(mut self, clock: WallClock) -> Self {
        self.clock = clock;
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Registers an endpoint. The URL is parsed and checked by the SSRF
    /// guard, its host resolved, so a URL pointing inside your network is
    /// refused now rather than at its first delivery (the worker checks
    /// again at every connection). Returns the endpoint and its secret, to
    /// show the owner once.
    pub async fn create(
        &self,
        new: NewEndpoint,
    ) -> Result<(WebhookEndpoint, Secret), WebhookError> {
        let url = self.guard.check(&new.url).await?;
        validate(&new.description, &new.event_types)?;
        let secret = match new.secret {
            Some(secret) => secret,
            None => Secret::generate()?,
        };
        let now = self.clock.now();
        let id = new
            .id
            .unwrap_or_else(|| format!("ep_{}", keel_core::id::new_id().simple()));
        if id.is_empty() || id.len() > 255 {
            return Err(WebhookError::invalid(
                "endpoint id",
                "must be 1 to 255 characters",
            ));
        }
        let endpoint = WebhookEndpoint {
            description: new.description,
            event_types: new.event_types,
            tenant: new.tenant,
            format: new.format,
            ..WebhookEndpoint::registered(
                id,
                url.to_string(),
                self.sealer.seal(secret.expose())?,
                now,
            )
        };
        self.store.webhook_endpoint_create(&endpoint).await?;
        metrics::counter!("keel_webhook_endpoints_created_total").increment(1);
        tracing::info!(endpoint = %endpoint.id, url = %endpoint.url, "webhook endpoint registered");
        Ok((endpoint, secret))
    }

    /// The endpoints `tenant` owns, oldest first.
    pub async fn list_of(&self, tenant: &str) -> Result<Vec<WebhookEndpoint>, WebhookError> {
        let mut all = self.list().await?;
        all.retain(|e| e.tenant == tenant);
        Ok(all)
    }

    /// One endpoint, if `tenant` owns it; another tenant's is
    /// [`WebhookError::EndpointNotFound`] too, so ids reveal nothing.
    pub async fn get_of(&self, tenant: &str, id: &str) -> Result<WebhookEndpoint, WebhookError> {
        match self.get(id).await {
            Ok(endpoint) if endpoint.tenant == tenant => Ok(endpoint),
            Ok(_) => Err(WebhookError::EndpointNotFound(id.to_owned())),
            Err(e) => Err(e),
        }
    }

    /// One endpoint.
    pub async fn get(&self, id: &str) -> Result<WebhookEndpoint, WebhookError> {
        self.store
            .webhook_endpoint_get(id)
            .await?
            .ok_or_else(|| WebhookError::EndpointNotFound(id.to_owned()))
    }

    /// Every endpoint, oldest first.
    pub async fn list(&self) -> Result<Vec<WebhookEndpoint>, WebhookError> {
        Ok(self.store.webhook_endpoint_list().await?)
    }

    /// Changes an endpoint's URL (checked like at registration),
    /// description and event types.
    pub async fn update(
        &self,
        id: &str,
        url: &str,
        description: &str,
        event_types: &[String],
    ) -> Result<WebhookEndpoint, WebhookError> {
        let url = self.guard.check(url).await?;
        validate(description, event_types)?;
        let mut endpoint = self.get(id).await?;
        endpoint.url = url.to_string();
        endpoint.description = description.to_owned();
        endpoint.event_types = event_types.to_vec();
        self.store
            .webhook_endpoint_update(&endpoint, self.clock.now())
            .await
            .map_err(|e| not_found(e, id))?;
        self.get(id).await
    }

    /// Rotates in a new random secret; the current one keeps signing for
    /// `grace` (see the module docs). Returns the endpoint and the new
    /// secret.
    pub async fn rotate_secret(
        &self,
        id: &str,
        grace: Duration,
    ) -> Result<(WebhookEndpoint, Secret), WebhookError> {
        let secret = Secret::generate()?;
        let endpoint = self.rotate_secret_to(id, secret.clone(), grace).await?;
        Ok((endpoint, secret))
    }

    /// Rotates in `secret`; the current one keeps signing for `grace`.
    pub async fn rotate_secret_to(
        &self,
        id: &str,
        secret: Secret,
        grace: Duration,
    ) -> Result<WebhookEndpoint, WebhookError> {
        let now = self.clock.now();
        let grace = chrono::Duration::from_std(grace)
            .map_err(|_| WebhookError::Config(format!("rotation grace {grace:?} is too long")))?;
        let stored = WebhookSecret {
            secret: self.sealer.seal(secret.expose())?,
            created_at: now,
            expires_at: None,
        };
        let endpoint = self
            .store
            .webhook_endpoint_rotate_secret(id, &stored, now + grace)
            .await
            .map_err(|e| not_found(e, id))?;
        metrics::counter!("keel_webhook_secret_rotations_total").increment(1);
        tracing::info!(
            endpoint = id,
            grace_secs = grace.num_seconds(),
            "webhook secret rotated"
        );
        Ok(endpoint)
    }

    /// Disables an endpoint by hand; its pending deliveries are parked as
    /// `disabled` (replay them after enabling it). `false` if it was
    /// disabled already.
    pub async fn disable(&self, id: &str, reason: &str) -> Result<bool, WebhookError> {
        self.store
            .webhook_endpoint_disable(id, reason, self.clock.now())
            .await
            .map_err(|e| not_found(e, id))
    }

    /// Enables an endpoint again. `false` if it was enabled.
    pub async fn enable(&self, id: &str) -> Result<bool, WebhookError> {
        let enabled = self
            .store
            .webhook_endpoint_enable(id, self.clock.now())
            .await
            .map_err(|e| not_found(e, id))?;
        if enabled {
            tracing::info!(endpoint = id, "webhook endpoint enabled");
        }
        Ok(enabled)
    }

    /// Deletes an endpoint with its deliveries and log. `false` if there was
    /// none.
    pub async fn delete(&self, id: &str) -> Result<bool, WebhookError> {
        Ok(self.store.webhook_endpoint_delete(id).await?)
    }
}

fn validate(description: &str, event_types: &[String]) -> Result<(), WebhookError> {
    if description.chars().count() > MAX_DESCRIPTION_LEN {
        return Err(WebhookError::invalid(
            "description",
            format!("longer than {MAX_DESCRIPTION_LEN} characters"),
        ));
    }
    if event_types.len() > MAX_EVENT_TYPES {
        return Err(WebhookError::invalid(
            "event types",
            format!("more than {MAX_EVENT_TYPES} filters"),
        ));
    }
    for pattern in event_types {
        let body = pattern.strip_suffix(".*").unwrap_or(pattern);
        // Visible ASCII, as event types are: an API document can then
        // state the rule exactly (`^(\*|[!-)+-~]{1,255}(\.\*)?)$`).
        let valid = pattern == "*"
            || (!body.is_empty()
                && body.len() <= super::sender::MAX_EVENT_TYPE_LEN
                && body.bytes().all(|b| b.is_ascii_graphic() && b != b'*'));
        if !valid {
            return Err(WebhookError::invalid(
                "event types",
                format!("{pattern:?} is not an event type, `prefix.*` or `*`"),
            ));
        }
    }
    Ok(())
}

pub(super) fn not_found(err: StoreError, id: &str) -> WebhookError {
    match err {
        StoreError::NotFound(_) => WebhookError::EndpointNotFound(id.to_owned()),
        other => WebhookError::Store(other),
    }
}
