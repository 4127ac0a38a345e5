//! The lease's keep-alive, and the validity it earns.

use std::time::Duration;

use etcd_client::Client;
use keel_core::clock;
use keel_store::DeadlineRenewer;

/// Keeps lease `lease` alive every third of `ttl` until the task is
/// aborted or etcd says the lease is gone, moving `valid_until` to `ttl`
/// after each keep-alive that was answered, counted from when it was sent.
/// A keep-alive not answered within a third of `ttl` is tried again at
/// once; nothing else extends the validity.
///
/// Once the validity has lapsed the leadership is over for good, even if
/// etcd comes back with the lease still alive: the holder has stopped
/// working, and a lease it kept renewing would let nobody else lead. The
/// task then revokes the lease until etcd accepts, so the next campaign
/// wins at once instead of a TTL later.
pub(crate) async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    valid_until: DeadlineRenewer,
) {
    let every = ttl / 3;
    let mut channel = None;
    loop {
        let sent = clock::now();
        if valid_until.has_passed() {
            tracing::warn!(lease, "no keep-alive answered for a TTL: leadership ended");
            revoke(client, lease, every).await;
            return;
        }
        match tokio::time::timeout(every, renew(&mut client, &mut channel, lease)).await {
            Ok(Ok(Some(granted))) if granted > 0 => {
                let granted = Duration::from_secs(granted.unsigned_abs());
                // Too late to extend a lapsed leadership: the next round
                // revokes.
                valid_until.extend(sent + granted.min(ttl));
            }
            Ok(Ok(_)) => {
                tracing::warn!(
                    lease,
                    "etcd says the election lease is gone: leadership ends"
                );
                valid_until.end();
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(lease, %error, "keep-alive failed; retrying");
                channel = None;
            }
            Err(_) => {
                tracing::warn!(lease, "keep-alive unanswered; retrying");
                channel = None;
            }
        }
        let next = sent + every;
        if next > clock::now() {
            tokio::time::sleep_until(next).await;
        } else {
            // Back off a little after a failure that took the whole period.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Revokes `lease`, trying every `every` until etcd accepts or says it is
/// gone already.
async fn revoke(mut client: Client, lease: i64, every: Duration) {
    loop {
        match tokio::time::timeout(every, client.lease_revoke(lease)).await {
            Ok(Ok(_)) => return,
            Ok(Err(error)) if error.to_string().contains("not found") => return,
            _ => tokio::time::sleep(every).await,
        }
    }
}

type KeepAliveChannel = (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

/// One keep-alive round trip: the TTL etcd granted, or `None` when the
/// stream ended.
async fn renew(
    client: &mut Client,
    channel: &mut Option<KeepAliveChannel>,
    lease: i64,
) -> Result<Option<i64>, etcd_client::Error> {
    if channel.is_none() {
        *channel = Some(client.lease_keep_alive(lease).await?);
    }
    let Some((keeper, stream)) = channel.as_mut() else {
        return Ok(None);
    };
    keeper.keep_alive().await?;
    Ok(stream.message().await?.map(|answer| answer.ttl()))
}
