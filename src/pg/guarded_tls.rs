//! The SQL connections' TLS connector with `require_auth` enforced: tokio-postgres answers whatever
//! authentication request the server sends (a password in the clear included), so the TLS stream it reads
//! through checks the server's first request against the URL's `require_auth` before tokio-postgres sees it,
//! and fails the read when it is not allowed. What TLS checks is `tls`'s; the policy is `require_auth`'s.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use super::require_auth::{FirstRequestScanner, Refused, RequireAuth, Scanned};

/// postgres-openssl's connector, whose streams check `require_auth`.
#[derive(Clone)]
pub struct Connector {
    inner: postgres_openssl::MakeTlsConnector,
    policy: RequireAuth,
}

impl Connector {
    /// `inner` with `policy` checked on every connection it makes.
    pub fn new(inner: postgres_openssl::MakeTlsConnector, policy: RequireAuth) -> Self {
        Connector { inner, policy }
    }
}

/// A TLS stream to PostgreSQL that refuses the server's first authentication request when `require_auth`
/// does not allow it.
pub struct Stream<S> {
    inner: S,
    policy: RequireAuth,
    scanner: FirstRequestScanner,
    /// Set once a request was refused: every later read fails the same way.
    refused: Option<Refused>,
}

impl MakeTlsConnect<Socket> for Connector {
    type Stream = Stream<postgres_openssl::TlsStream<Socket>>;
    type TlsConnect = Connect;
    type Error = openssl::error::ErrorStack;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, Self::Error> {
        Ok(Connect {
            inner: MakeTlsConnect::<Socket>::make_tls_connect(&mut self.inner, domain)?,
            policy: self.policy.clone(),
        })
    }
}

/// One connection's TLS handshake (postgres-openssl's), then the checking stream.
pub struct Connect {
    inner: postgres_openssl::TlsConnector,
    policy: RequireAuth,
}

impl TlsConnect<Socket> for Connect {
    type Stream = Stream<postgres_openssl::TlsStream<Socket>>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Stream, Self::Error>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        let Connect { inner, policy } = self;
        Box::pin(async move {
            let inner = inner.connect(stream).await?;
            Ok(Stream {
                inner,
                policy,
                scanner: FirstRequestScanner::default(),
                refused: None,
            })
        })
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        if let Some(refused) = &this.refused {
            return Poll::Ready(Err(refusal(refused.clone())));
        }
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        if let Scanned::FirstRequest(Some(method)) = this.scanner.feed(&buf.filled()[before..]) {
            if let Err(refused) = this.policy.check(method) {
                // tokio-postgres never sees the request, so never answers it.
                buf.set_filled(before);
                this.refused = Some(refused.clone());
                return Poll::Ready(Err(refusal(refused)));
            }
        }
        Poll::Ready(Ok(()))
    }
}

fn refusal(refused: Refused) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, refused)
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, bytes)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: tokio_postgres::tls::TlsStream + Unpin> tokio_postgres::tls::TlsStream for Stream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        self.inner.channel_binding()
    }
}
