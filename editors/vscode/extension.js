// The shardplan language client: starts `shardplan lsp` (stdio) for .splan files and tells it at
// `initialize` whether it may run model code: only when VS Code trusts this workspace
// (vscode.workspace.isTrusted) and the `shardplan.trustModelCode` setting allows it.
"use strict";
const vscode = require("vscode");
const { LanguageClient, TransportKind } = require("vscode-languageclient/node");

let client;

function createClient() {
  const config = vscode.workspace.getConfiguration("shardplan");
  const [command, ...args] = config.get("server.command", ["shardplan", "lsp"]);
  return new LanguageClient(
    "shardplan",
    "shardplan",
    { command, args, transport: TransportKind.stdio },
    {
      documentSelector: [{ scheme: "file", language: "splan" }],
      initializationOptions: {
        trustModelCode: vscode.workspace.isTrusted && config.get("trustModelCode", true) === true,
      },
    },
  );
}

// The server reads its options once, at initialize: a new one when they change.
async function restart() {
  if (client) {
    await client.stop();
  }
  client = createClient();
  await client.start();
}

async function activate(context) {
  context.subscriptions.push(
    // Leaving Restricted Mode (VS Code's API has an event for trust granted only).
    vscode.workspace.onDidGrantWorkspaceTrust(restart),
    vscode.workspace.onDidChangeConfiguration((e) => {
      if (e.affectsConfiguration("shardplan")) {
        return restart();
      }
    }),
  );
  await restart();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
