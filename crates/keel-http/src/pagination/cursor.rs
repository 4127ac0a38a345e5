//! The cursor: a position in a list, opaque and tamper-evident.

use std::fmt;
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The cursor format this version writes (the first byte of every cursor).
pub const CURSOR_VERSION: u8 = 1;

/// The longest cursor accepted, in characters: 512. A cursor is a sort key
/// and an id; anything longer is not one of ours.
pub const DEFAULT_MAX_CURSOR_LEN: usize = 512;

/// The shortest signing key accepted: 32 bytes (the HMAC-SHA256 output size).
pub const MIN_KEY_LEN: usize = 32;

/// Bytes of HMAC-SHA256 tag at the end of every cursor (the full 32).
const TAG_LEN: usize = 32;

/// A position in a keyset-paginated list: the last row's sort key and id.
///
/// The id breaks ties between rows with the same sort key, which is what
/// makes the seek `(sort, id) < (?, ?)` exact. Serialized as `[sort, id]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Cursor<S, I> {
    /// The sort key of the last row returned (e.g. `created_at`).
    pub sort: S,
    /// The id of the last row returned.
    pub id: I,
}

impl<S, I> Cursor<S, I> {
    /// A cursor at `(sort, id)`.
    pub fn new(sort: S, id: I) -> Self {
        Self { sort, id }
    }
}

impl<S: Serialize, I: Serialize> Serialize for Cursor<S, I> {
    fn serialize<Ser: serde::Serializer>(&self, serializer: Ser) -> Result<Ser::Ok, Ser::Error> {
        (&self.sort, &self.id).serialize(serializer)
    }
}

impl<'de, S: Deserialize<'de>, I: Deserialize<'de>> Deserialize<'de> for Cursor<S, I> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (sort, id) = <(S, I)>::deserialize(deserializer)?;
        Ok(Self { sort, id })
    }
}

/// Why a cursor could not be read (or, rarely, written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CursorError {
    /// Longer than the limit: not a cursor this server issued.
    #[error("cursor is {len} characters long; the limit is {max}")]
    TooLong {
        /// The cursor's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not base64url.
    #[error("cursor is not valid base64url")]
    NotBase64,
    /// Too short to hold a version, a position and a signature.
    #[error("cursor is truncated")]
    Truncated,
    /// A format this server does not read (from a newer or retired version).
    #[error("cursor version {0} is not supported; start again from the first page")]
    UnsupportedVersion(u8),
    /// The signature does not match: changed, truncated, or issued for
    /// another list.
    #[error("cursor signature does not match (altered, or issued for another list)")]
    BadSignature,
    /// Signed correctly but its position does not decode (a change of the
    /// list's sort key type since it was issued).
    #[error("cursor position does not match this list; start again from the first page")]
    Position,
    /// The position could not be serialized (a bug in the caller's type).
    #[error("cursor position could not be encoded: {0}")]
    Encode(String),
}

/// A signing key that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor signing key is {len} bytes; use at least {MIN_KEY_LEN} random bytes")]
pub struct CursorKeyError {
    /// The key's length.
    pub len: usize,
}

/// Signs and verifies cursors with a server-side key (HMAC-SHA256).
///
/// The cursor is `base64url(version ‖ JSON position ‖ tag)`, where the tag
/// signs the version, the list's *scope* and the position. Opaque, so
/// clients cannot build one and make the index choice a public API;
/// signed, so a changed or truncated cursor is refused with `400`
/// instead of reaching SQL; scoped, so a cursor issued for one list is
/// refused by another. The key can be rotated: cursors signed with a
/// [previous key](Self::with_previous_key) still verify. Cheap to clone.
#[derive(Clone)]
pub struct CursorCodec {
    /// Keyed MACs, the current key first, then previous ones.
    keys: Arc<[HmacSha256]>,
    max_len: usize,
}

impl fmt::Debug for CursorCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CursorCodec")
            .field("keys", &self.keys.len())
            .field("max_len", &self.max_len)
            .finish()
    }
}

impl CursorCodec {
    /// A codec signing with `key` (at least [`MIN_KEY_LEN`] random bytes,
    /// kept secret and the same on every instance of the service).
    pub fn new(key: impl Into<Vec<u8>>) -> Result<Self, CursorKeyError> {
        let key = keyed(key.into())?;
        Ok(Self {
            keys: Arc::from(vec![key]),
            max_len: DEFAULT_MAX_CURSOR_LEN,
        })
    }

    /// Also accepts cursors signed with `key`, the key used before a
    /// rotation (new cursors are signed with the current key only).
    pub fn with_previous_key(self, key: impl Into<Vec<u8>>) -> Result<Self, CursorKeyError> {
        let key = keyed(key.into())?;
        let mut keys = self.keys.to_vec();
        keys.push(key);
        Ok(Self {
            keys: Arc::from(keys),
            max_len: self.max_len,
        })
    }

    /// The longest cursor accepted, in characters (default
    /// [`DEFAULT_MAX_CURSOR_LEN`]). Longer ones are refused before decoding.
    pub fn with_max_len(mut self, chars: usize) -> Self {
        self.max_len = chars;
        self
    }

    /// The longest cursor accepted, in characters.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The cursor for `position` in the list named `scope`.
    pub fn encode<P: Serialize>(&self, scope: &str, position: &P) -> Result<String, CursorError> {
        let payload =
            serde_json::to_vec(position).map_err(|e| CursorError::Encode(e.to_string()))?;
        let mut bytes = Vec::with_capacity(1 + payload.len() + TAG_LEN);
        bytes.push(CURSOR_VERSION);
        bytes.extend_from_slice(&payload);
        let tag = mac(&self.keys[0], CURSOR_VERSION, scope, &payload)
            .finalize()
            .into_bytes();
        bytes.extend_from_slice(&tag);
        let cursor = URL_SAFE_NO_PAD.encode(bytes);
        if cursor.len() > self.max_len {
            return Err(CursorError::Encode(format!(
                "cursor would be {} characters, over the {}-character limit",
                cursor.len(),
                self.max_len
            )));
        }
        Ok(cursor)
    }

    /// The position in `cursor`, if this server signed it for `scope`.
    /// The signature is checked (in constant time) before the position is
    /// parsed, so unsigned input never reaches the JSON parser.
    pub fn decode<P: DeserializeOwned>(&self, scope: &str, cursor: &str) -> Result<P, CursorError> {
        if cursor.len() > self.max_len {
            return Err(CursorError::TooLong {
                len: cursor.len(),
                max: self.max_len,
            });
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(cursor.as_bytes())
            .map_err(|_| CursorError::NotBase64)?;
        let Some((&version, rest)) = bytes.split_first() else {
            return Err(CursorError::Truncated);
        };
        if version != CURSOR_VERSION {
            return Err(CursorError::UnsupportedVersion(version));
        }
        if rest.len() < TAG_LEN + 1 {
            return Err(CursorError::Truncated);
        }
        let (payload, tag) = rest.split_at(rest.len() - TAG_LEN);
        let verified = self
            .keys
            .iter()
            .any(|key| mac(key, version, scope, payload).verify_slice(tag).is_ok());
        if !verified {
            return Err(CursorError::BadSignature);
        }
        serde_json::from_slice(payload).map_err(|_| CursorError::Position)
    }
}

fn keyed(key: Vec<u8>) -> Result<HmacSha256, CursorKeyError> {
    let len = key.len();
    if len < MIN_KEY_LEN {
        return Err(CursorKeyError { len });
    }
    <HmacSha256 as Mac>::new_from_slice(&key).map_err(|_| CursorKeyError { len })
}

fn mac(key: &HmacSha256, version: u8, scope: &str, payload: &[u8]) -> HmacSha256 {
    let mut mac = key.clone();
    mac.update(&[version]);
    mac.update(&(scope.len() as u64).to_be_bytes());
    mac.update(scope.as_bytes());
    mac.update(payload);
    mac
}
