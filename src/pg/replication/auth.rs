//! The replication connection's authentication exchange as a state machine: what to answer to each of the
//! server's authentication requests, and which sequences to refuse. Pure (no I/O): `connection` reads the
//! requests and writes the answers.
//!
//! It refuses what libpq refuses: `AuthenticationOk` while a SCRAM exchange is open (the server never proved
//! it knows the password: a man in the middle skipping SCRAM's last step), SASL messages out of order or a
//! wrong server signature, a password sent in the clear or as MD5 when the URL asks for channel binding, and
//! `channel_binding=require` met by anything but a finished SCRAM-SHA-256-PLUS exchange.

use postgres_protocol::authentication::{md5_hash, sasl};
use tokio_postgres::config::ChannelBinding;

use crate::pg::require_auth::{Method, Refused, RequireAuth};

/// Why authentication was refused or could not go on.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The server asks for a password and the URL has none.
    #[error("the server asks for a password but the connection URL has none: add it to the URL or use PGPASSWORD-free auth (trust)")]
    PasswordRequired,
    /// The URL's `channel_binding=require` cannot be met; holds why.
    #[error("channel_binding=require, but {0}")]
    ChannelBindingRequired(String),
    /// The server did not follow SCRAM: a step skipped or out of order, or a server signature that does not
    /// prove it knows the password. Holds what happened.
    #[error("the server broke SCRAM authentication off ({0}): refusing the replication connection, since the server never proved it knows the password (a man in the middle, or a proxy that does not speak SCRAM)")]
    Scram(String),
    /// The server asks for a method the URL's `require_auth` does not allow.
    #[error(transparent)]
    MethodRefused(#[from] Refused),
    /// The server asks for a method outboxd does not support, or sent a message authentication has no place
    /// for.
    #[error("{0}")]
    Unsupported(String),
}

/// What the connection's TLS gives SCRAM's channel binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Channel {
    /// No TLS.
    Plain,
    /// TLS, with its `tls-server-end-point` data (`None`: the server certificate's signature names no hash
    /// to compute it with, e.g. Ed25519).
    Tls {
        /// The `tls-server-end-point` channel-binding data (RFC 5929).
        end_point: Option<Vec<u8>>,
    },
}

/// A request of the server's during authentication.
#[derive(Debug)]
pub enum Request<'a> {
    /// AuthenticationOk: the server lets the connection in.
    Ok,
    /// AuthenticationCleartextPassword.
    Cleartext,
    /// AuthenticationMD5Password with its salt.
    Md5([u8; 4]),
    /// AuthenticationSASL with the mechanisms the server offers.
    Sasl(Vec<&'a str>),
    /// AuthenticationSASLContinue with the server-first message.
    SaslContinue(&'a [u8]),
    /// AuthenticationSASLFinal with the server-final message (its signature).
    SaslFinal(&'a [u8]),
}

/// What to send the server next.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// Nothing: the connection is authenticated.
    Authenticated,
    /// Nothing: the server's next request follows.
    Wait,
    /// A PasswordMessage with these bytes (the password, or its MD5 hash).
    Password(Vec<u8>),
    /// SASLInitialResponse: the chosen mechanism and the client-first message.
    SaslInitial(&'static str, Vec<u8>),
    /// SASLResponse with the client-final message.
    SaslResponse(Vec<u8>),
}

enum State {
    Start,
    /// A password was sent in answer to a cleartext or MD5 request.
    PasswordSent,
    /// The client-first message was sent; `plus` when bound to the TLS channel.
    ScramStarted {
        scram: Box<sasl::ScramSha256>,
        plus: bool,
    },
    /// The client-final message was sent.
    ScramContinued {
        scram: Box<sasl::ScramSha256>,
        plus: bool,
    },
    /// The server's signature was verified.
    ScramFinished {
        plus: bool,
    },
    /// An error was returned: nothing more is accepted.
    Failed,
}

/// One authentication exchange.
pub struct Authentication<'a> {
    user: &'a str,
    password: Option<&'a [u8]>,
    wanted: ChannelBinding,
    allowed: &'a RequireAuth,
    channel: Channel,
    state: State,
}

impl<'a> Authentication<'a> {
    /// `channel`: the connection's TLS; `wanted`: the URL's `channel_binding` (libpq's: disable, prefer,
    /// require); `allowed`: its `require_auth`.
    pub fn new(
        user: &'a str,
        password: Option<&'a [u8]>,
        wanted: ChannelBinding,
        allowed: &'a RequireAuth,
        channel: Channel,
    ) -> Self {
        Authentication {
            user,
            password,
            wanted,
            allowed,
            channel,
            state: State::Start,
        }
    }

    /// The answer to the server's next request. After an error the exchange is over.
    pub fn answer(&mut self, request: Request<'_>) -> Result<Answer, AuthError> {
        let result = self.step(request);
        if result.is_err() {
            self.state = State::Failed;
        }
        result
    }

    fn step(&mut self, request: Request<'_>) -> Result<Answer, AuthError> {
        let require = self.wanted == ChannelBinding::Require;
        if matches!(self.state, State::Start) {
            let method = match &request {
                Request::Ok => Some(Method::None),
                Request::Cleartext => Some(Method::Password),
                Request::Md5(_) => Some(Method::Md5),
                Request::Sasl(_) => Some(Method::ScramSha256),
                Request::SaslContinue(_) | Request::SaslFinal(_) => None,
            };
            if let Some(method) = method {
                self.allowed.check(method)?;
            }
        }
        let state = std::mem::replace(&mut self.state, State::Failed);
        match (state, request) {
            (State::ScramFinished { plus }, Request::Ok) => {
                if require && !plus {
                    return Err(binding_required(
                        "the server authenticated the replication connection without channel binding",
                    ));
                }
                Ok(Answer::Authenticated)
            }
            (State::Start | State::PasswordSent, Request::Ok) if require => Err(binding_required(
                "the server let the replication connection in without SCRAM authentication",
            )),
            (State::Start | State::PasswordSent, Request::Ok) => Ok(Answer::Authenticated),
            (State::ScramStarted { .. } | State::ScramContinued { .. }, Request::Ok) => Err(
                AuthError::Scram("AuthenticationOk before the server's final SCRAM message".into()),
            ),
            (State::Start, Request::Cleartext | Request::Md5(_)) if require => {
                Err(binding_required(
                    "the server asks the replication connection for a plain or MD5 password",
                ))
            }
            (State::Start, Request::Cleartext) => {
                let password = self.password.ok_or(AuthError::PasswordRequired)?;
                self.state = State::PasswordSent;
                Ok(Answer::Password(password.to_vec()))
            }
            (State::Start, Request::Md5(salt)) => {
                let password = self.password.ok_or(AuthError::PasswordRequired)?;
                self.state = State::PasswordSent;
                Ok(Answer::Password(
                    md5_hash(self.user.as_bytes(), password, salt).into_bytes(),
                ))
            }
            (State::Start, Request::Sasl(mechanisms)) => self.start_scram(&mechanisms),
            (State::ScramStarted { mut scram, plus }, Request::SaslContinue(data)) => {
                scram
                    .update(data)
                    .map_err(|e| AuthError::Scram(format!("server-first message: {e}")))?;
                let answer = Answer::SaslResponse(scram.message().to_vec());
                self.state = State::ScramContinued { scram, plus };
                Ok(answer)
            }
            (State::ScramContinued { mut scram, plus }, Request::SaslFinal(data)) => {
                scram
                    .finish(data)
                    .map_err(|e| AuthError::Scram(format!("server-final message: {e}")))?;
                self.state = State::ScramFinished { plus };
                Ok(Answer::Wait)
            }
            (_, Request::SaslContinue(_)) => Err(AuthError::Scram(
                "a SCRAM continue message out of order".into(),
            )),
            (_, Request::SaslFinal(_)) => Err(AuthError::Scram(
                "a SCRAM final message out of order".into(),
            )),
            (State::ScramStarted { .. } | State::ScramContinued { .. }, _) => Err(
                AuthError::Scram("another authentication request in the middle of SCRAM".into()),
            ),
            (_, request) => Err(AuthError::Unsupported(format!(
                "unexpected authentication request {request:?} after authentication was answered"
            ))),
        }
    }

    fn start_scram(&mut self, mechanisms: &[&str]) -> Result<Answer, AuthError> {
        let require = self.wanted == ChannelBinding::Require;
        let password = self.password.ok_or(AuthError::PasswordRequired)?;
        let has_scram = mechanisms.contains(&sasl::SCRAM_SHA_256);
        let has_plus = mechanisms.contains(&sasl::SCRAM_SHA_256_PLUS);
        let channel = match &self.channel {
            _ if self.wanted == ChannelBinding::Disable => &Channel::Plain,
            channel => channel,
        };
        // As libpq: over TLS the client says it could bind ("y") even when the server offers no PLUS, so
        // that a server that does offer it (behind a man in the middle who hides it) refuses.
        let (mechanism, binding, plus) = match channel {
            Channel::Tls {
                end_point: Some(data),
            } if has_plus => (
                sasl::SCRAM_SHA_256_PLUS,
                sasl::ChannelBinding::tls_server_end_point(data.clone()),
                true,
            ),
            Channel::Tls { end_point: None } if has_plus || require => {
                return Err(AuthError::Unsupported(
                    "the server's TLS certificate is signed with an algorithm that names no hash (e.g. Ed25519), so SCRAM cannot be bound to the TLS channel; use a certificate signed with SHA-256, or channel_binding=disable".into(),
                ))
            }
            _ if require => {
                return Err(binding_required(if matches!(channel, Channel::Tls { .. }) {
                    "the server does not offer SCRAM-SHA-256-PLUS on the replication connection"
                } else {
                    "the replication connection has no TLS"
                }))
            }
            Channel::Tls { .. } => (
                sasl::SCRAM_SHA_256,
                sasl::ChannelBinding::unrequested(),
                false,
            ),
            Channel::Plain => (
                sasl::SCRAM_SHA_256,
                sasl::ChannelBinding::unsupported(),
                false,
            ),
        };
        if !has_scram && !plus {
            return Err(AuthError::Unsupported(
                "the server offers no SASL mechanism outboxd supports (SCRAM-SHA-256)".into(),
            ));
        }
        let scram = Box::new(sasl::ScramSha256::new(password, binding));
        let answer = Answer::SaslInitial(mechanism, scram.message().to_vec());
        self.state = State::ScramStarted { scram, plus };
        Ok(answer)
    }
}

fn binding_required(why: &str) -> AuthError {
    AuthError::ChannelBindingRequired(format!(
        "{why} (channel binding needs SCRAM-SHA-256 over TLS)"
    ))
}

#[cfg(test)]
mod tests {
    use base64::Engine;

    use super::*;

    const BINDING: &[u8] = b"certificate hash";
    static ANY_METHOD: std::sync::LazyLock<RequireAuth> =
        std::sync::LazyLock::new(RequireAuth::default);
    const PASSWORD: &[u8] = b"secret";

    fn auth(wanted: ChannelBinding, tls: bool) -> Authentication<'static> {
        let channel = if tls {
            Channel::Tls {
                end_point: Some(BINDING.to_vec()),
            }
        } else {
            Channel::Plain
        };
        Authentication::new("outboxd", Some(PASSWORD), wanted, &ANY_METHOD, channel)
    }

    fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
        let key = openssl::pkey::PKey::hmac(key).unwrap();
        let mut signer =
            openssl::sign::Signer::new(openssl::hash::MessageDigest::sha256(), &key).unwrap();
        signer.update(data).unwrap();
        signer.sign_to_vec().unwrap()
    }

    fn base64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    /// The server's side of SCRAM-SHA-256 (RFC 5802/7677) for a user whose password is `password`.
    struct Server {
        password: &'static [u8],
        client_first_bare: String,
        server_first: String,
    }

    const SALT: &[u8] = b"saltsalt";
    const ITERATIONS: usize = 4096;

    impl Server {
        /// Reads the client-first message; [`Server::first`] is the answer.
        fn new(password: &'static [u8], client_first: &[u8]) -> Server {
            let client_first = std::str::from_utf8(client_first).unwrap();
            // The gs2 header ("p=tls-server-end-point,,", "y,,", "n,,"), then the bare message.
            let bare = &client_first[client_first.find(",,").unwrap() + 2..];
            // Everything after the attribute: the nonce may hold "r=" itself (it did, once in about 40 runs).
            let client_nonce = bare.split_once(",r=").unwrap().1;
            Server {
                password,
                client_first_bare: bare.to_string(),
                server_first: format!("r={client_nonce}server,s={},i={ITERATIONS}", base64(SALT)),
            }
        }

        fn first(&self) -> &[u8] {
            self.server_first.as_bytes()
        }

        /// The server-final message for the client-final one, signed with the password's server key.
        fn last(&self, client_final: &[u8]) -> Vec<u8> {
            let client_final = std::str::from_utf8(client_final).unwrap();
            let without_proof = &client_final[..client_final.find(",p=").unwrap()];
            let mut salted = [0u8; 32];
            openssl::pkcs5::pbkdf2_hmac(
                self.password,
                SALT,
                ITERATIONS,
                openssl::hash::MessageDigest::sha256(),
                &mut salted,
            )
            .unwrap();
            let server_key = hmac(&salted, b"Server Key");
            let auth_message = format!(
                "{},{},{without_proof}",
                self.client_first_bare, self.server_first
            );
            format!("v={}", base64(&hmac(&server_key, auth_message.as_bytes()))).into_bytes()
        }
    }

    /// Runs SCRAM from the server's SASL offer to its final message, against a server knowing
    /// `server_password`; returns the answer to the final message.
    fn scram(
        client: &mut Authentication<'_>,
        offered: &[&str],
        server_password: &'static [u8],
    ) -> Result<Answer, AuthError> {
        let Answer::SaslInitial(_, client_first) =
            client.answer(Request::Sasl(offered.to_vec()))?
        else {
            panic!("no client-first message")
        };
        let server = Server::new(server_password, &client_first);
        let Answer::SaslResponse(client_final) =
            client.answer(Request::SaslContinue(server.first()))?
        else {
            panic!("no client-final message")
        };
        client.answer(Request::SaslFinal(&server.last(&client_final)))
    }

    const BOTH: [&str; 2] = [sasl::SCRAM_SHA_256_PLUS, sasl::SCRAM_SHA_256];

    #[test]
    fn a_finished_scram_exchange_authenticates() {
        for (wanted, tls) in [
            (ChannelBinding::Require, true),
            (ChannelBinding::Prefer, true),
            (ChannelBinding::Prefer, false),
            (ChannelBinding::Disable, true),
        ] {
            let mut client = auth(wanted, tls);
            assert_eq!(scram(&mut client, &BOTH, PASSWORD).unwrap(), Answer::Wait);
            assert_eq!(client.answer(Request::Ok).unwrap(), Answer::Authenticated);
        }
    }

    #[test]
    fn channel_binding_is_chosen_when_offered_and_possible() {
        let mut bound = auth(ChannelBinding::Prefer, true);
        let Ok(Answer::SaslInitial(mechanism, first)) = bound.answer(Request::Sasl(BOTH.to_vec()))
        else {
            panic!()
        };
        assert_eq!(mechanism, sasl::SCRAM_SHA_256_PLUS);
        assert!(first.starts_with(b"p=tls-server-end-point,,"));
        let mut disabled = auth(ChannelBinding::Disable, true);
        let Ok(Answer::SaslInitial(mechanism, first)) =
            disabled.answer(Request::Sasl(BOTH.to_vec()))
        else {
            panic!()
        };
        assert_eq!(mechanism, sasl::SCRAM_SHA_256);
        assert!(first.starts_with(b"n,,"));
    }

    #[test]
    fn authentication_ok_before_the_servers_final_message_is_refused() {
        // Review H2: a man in the middle offers SCRAM-SHA-256-PLUS, takes the client-first message and
        // lets the connection in.
        for wanted in [
            ChannelBinding::Require,
            ChannelBinding::Prefer,
            ChannelBinding::Disable,
        ] {
            let mut client = auth(wanted, true);
            client.answer(Request::Sasl(BOTH.to_vec())).unwrap();
            let error = client.answer(Request::Ok).unwrap_err();
            assert!(matches!(error, AuthError::Scram(_)), "{wanted:?}: {error}");
            assert!(
                client.answer(Request::Ok).is_err(),
                "nothing after a refusal"
            );
        }
        // ... or after the client-final message.
        let mut client = auth(ChannelBinding::Require, true);
        let Answer::SaslInitial(_, first) = client.answer(Request::Sasl(BOTH.to_vec())).unwrap()
        else {
            panic!()
        };
        let server = Server::new(PASSWORD, &first);
        client
            .answer(Request::SaslContinue(server.first()))
            .unwrap();
        assert!(matches!(
            client.answer(Request::Ok),
            Err(AuthError::Scram(_))
        ));
    }

    #[test]
    fn a_server_that_does_not_know_the_password_is_refused() {
        let mut client = auth(ChannelBinding::Prefer, true);
        let error = scram(&mut client, &BOTH, b"another password").unwrap_err();
        assert!(matches!(error, AuthError::Scram(_)), "{error}");
    }

    #[test]
    fn over_tls_without_binding_data_the_client_says_it_could_bind_or_refuses() {
        // Adversarial review: a certificate without a hash made the client say "no TLS" ("n"), which a
        // server behind a man in the middle accepts; libpq says "y" (or fails when PLUS is offered).
        let no_hash = || Channel::Tls { end_point: None };
        let mut client = Authentication::new(
            "u",
            Some(PASSWORD),
            ChannelBinding::Prefer,
            &ANY_METHOD,
            no_hash(),
        );
        let Answer::SaslInitial(mechanism, first) = client
            .answer(Request::Sasl(vec![sasl::SCRAM_SHA_256]))
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(mechanism, sasl::SCRAM_SHA_256);
        assert!(
            first.starts_with(b"y,,"),
            "{}",
            String::from_utf8_lossy(&first)
        );
        for wanted in [ChannelBinding::Prefer, ChannelBinding::Require] {
            let mut client =
                Authentication::new("u", Some(PASSWORD), wanted, &ANY_METHOD, no_hash());
            assert!(
                client.answer(Request::Sasl(BOTH.to_vec())).is_err(),
                "{wanted:?}"
            );
        }
    }

    #[test]
    fn scram_messages_out_of_order_are_refused() {
        let mut final_first = auth(ChannelBinding::Prefer, true);
        final_first.answer(Request::Sasl(BOTH.to_vec())).unwrap();
        assert!(matches!(
            final_first.answer(Request::SaslFinal(b"v=AAAA")),
            Err(AuthError::Scram(_))
        ));
        let mut continue_unasked = auth(ChannelBinding::Prefer, true);
        assert!(matches!(
            continue_unasked.answer(Request::SaslContinue(b"r=x,s=AAAA,i=1")),
            Err(AuthError::Scram(_))
        ));
        let mut password_midway = auth(ChannelBinding::Prefer, true);
        password_midway
            .answer(Request::Sasl(BOTH.to_vec()))
            .unwrap();
        assert!(password_midway.answer(Request::Cleartext).is_err());
    }

    #[test]
    fn channel_binding_required_accepts_only_a_finished_plus_exchange() {
        // No PLUS offered.
        let mut client = auth(ChannelBinding::Require, true);
        let error = client
            .answer(Request::Sasl(vec![sasl::SCRAM_SHA_256]))
            .unwrap_err();
        assert!(
            matches!(error, AuthError::ChannelBindingRequired(_)),
            "{error}"
        );
        // No TLS.
        let mut client = auth(ChannelBinding::Require, false);
        assert!(matches!(
            client.answer(Request::Sasl(BOTH.to_vec())),
            Err(AuthError::ChannelBindingRequired(_))
        ));
        // Let in without authentication (trust), or asked for a password in the clear or as MD5.
        for request in [Request::Ok, Request::Cleartext, Request::Md5(*b"salt")] {
            let mut client = auth(ChannelBinding::Require, true);
            assert!(matches!(
                client.answer(request),
                Err(AuthError::ChannelBindingRequired(_))
            ));
        }
    }

    #[test]
    fn cleartext_and_md5_are_answered_unless_binding_is_required() {
        let mut client = auth(ChannelBinding::Prefer, true);
        assert_eq!(
            client.answer(Request::Cleartext).unwrap(),
            Answer::Password(PASSWORD.to_vec())
        );
        assert_eq!(client.answer(Request::Ok).unwrap(), Answer::Authenticated);
        let mut client = auth(ChannelBinding::Prefer, false);
        let Answer::Password(hash) = client.answer(Request::Md5(*b"salt")).unwrap() else {
            panic!()
        };
        assert!(hash.starts_with(b"md5"));
        let mut without = Authentication::new(
            "outboxd",
            None,
            ChannelBinding::Prefer,
            &ANY_METHOD,
            Channel::Plain,
        );
        assert!(matches!(
            without.answer(Request::Cleartext),
            Err(AuthError::PasswordRequired)
        ));
    }
}
